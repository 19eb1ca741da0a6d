"""The generated short-convolution layer (agent/recipe/native/parts/code/short_conv.py) against transformers' lfm2
Lfm2ShortConv on a tiny config, as the executor drives it: `python tests/support/short_conv_layer_check.py JSON`
under the npu stand-in, a cann-recipes-infer checkout on sys.path. JSON: a list of jobs {"dtype", "fault"}. A packed
prefill of prompts of unequal length (one shorter than the conv's history), then decode steps, each request's conv
state in its block of the Mamba cache (block 0, no request's, holds NaN); each step's outputs against transformers'
layer on the whole sequence so far (no cache). Prints one line: CHECK [{"ok", "max_rel", "step"} per job].

Faults (a planted error in the layer's arithmetic or its state handling): "conv_state" (decode forgets the conv
history), "gates" (B and C read the other way round), "taps" (the prefill's conv kernel read back to front)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import gdn_layer_check  # its driver, beside this file

LENGTHS = (7, 4, 1)
DECODE_STEPS = 3
CODE = Path(__file__).resolve().parents[2] / "agent" / "recipe" / "native" / "parts" / "code" / "short_conv.py"
FAULTS = {
    "conv_state": ("self.conv_state.index_select(0, blocks)", "torch.zeros_like(self.conv_state.index_select(0, blocks))"),
    "gates": ("gate_b, gate_c, x = self.in_proj(", "gate_c, gate_b, x = self.in_proj("),
    "taps": ("weight[:, kernel - 1 - shift]", "weight[:, shift]"),
}


def _load(fault):
    return gdn_layer_check.load_code(CODE, "short_conv_under_check", [FAULTS[fault]] if fault else ())


def _reference(config):
    import torch
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    layer = Lfm2ShortConv(config, 0).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return layer


def check(job):
    import torch
    from transformers import AutoConfig

    dtype = getattr(torch, job.get("dtype", "float32"))
    config = AutoConfig.for_model("lfm2", hidden_size=32, num_hidden_layers=2, layer_types=["conv", "full_attention"],
                                  conv_L_cache=3, conv_bias=job.get("conv_bias", False), vocab_size=64)
    reference = _reference(config)
    rounded = _reference(config).to(dtype)
    module = _load(job.get("fault"))
    infer_config = SimpleNamespace(parallel_config=SimpleNamespace(attn_tp_size=1))
    torch.set_default_dtype(dtype)
    try:
        layer = module.ModelShortConv(config, infer_config, None, 0, prefix="model.layers.0.linear_attn").eval()
    finally:
        torch.set_default_dtype(torch.float32)
    params = dict(layer.named_parameters())
    state = reference.state_dict()
    assert set(params) == set(state), (sorted(params), sorted(state))
    for name, tensor in state.items():
        params[name].data.copy_(tensor.to(params[name].dtype))
    (entry,) = layer.cache_entries
    return gdn_layer_check.drive(layer, reference, rounded, config.hidden_size, dtype, LENGTHS, DECODE_STEPS,
                                 run_dtype_steps=DECODE_STEPS)


if __name__ == "__main__":
    print("CHECK " + json.dumps([check(job) for job in json.loads(sys.argv[1])]))
