"""The generated Mamba2 mixer (agent/recipe/native/parts/code/linear_attention_mamba2.py) against transformers' own
layer (BambaMixer) on a tiny config, as the executor drives it: `python tests/support/mamba2_layer_check.py JSON`
under the npu stand-in, a cann-recipes-infer checkout on sys.path. JSON: a list of jobs {"dtype", "fault", "groups"
(mamba_n_groups; unless given, 2 where the installed transformers norms the gated output per group as mamba_ssm's
fused kernel does, 1 under 5.0, whose torch path norms it over the whole width)}. A packed
prefill of prompts of unequal length (one shorter than the conv's history, one longer than transformers' SSD chunk),
then decode steps, each request's conv and ssm state in its block of the Mamba cache; every block is NaN before the
prefill (a prefill reads no state) and block 0, no request's, is NaN before each step. Each step's outputs are held
to transformers' layer run on the whole sequence so far (no cache: its chunked SSD from zero state). Prints one line:
CHECK [{"ok", "max_rel", "step"} per job].

Faults (a planted error in the layer's arithmetic or its state handling): "conv_state" (decode forgets the conv
history), "ssm_state" (decode starts from a zero ssm state), "skip" (the D x skip dropped)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import gdn_layer_check  # its driver, beside this file

LENGTHS = (13, 6, 2)
DECODE_STEPS = 4
CODE = (Path(__file__).resolve().parents[2] / "agent" / "recipe" / "native" / "parts" / "code"
        / "linear_attention_mamba2.py")
FAULTS = {
    "conv_state": ("self.conv_state.index_select(0, blocks), weight",
                   "torch.zeros_like(self.conv_state.index_select(0, blocks)), weight"),
    "ssm_state": ("state = self.ssm_state.index_select(0, blocks).float()",
                  "state = torch.zeros_like(self.ssm_state.index_select(0, blocks)).float()"),
    "skip": ("+ D[:, None] * x[t]", ""),
}


def _config(groups):
    from transformers import AutoConfig

    return AutoConfig.for_model("bamba", hidden_size=64, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=groups,
                                mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
                                num_hidden_layers=1, attn_layer_indices=[], vocab_size=64)


def _grouped_norm_groups():
    import inspect

    from transformers.models.bamba import modeling_bamba

    return 2 if "group_size" in inspect.signature(modeling_bamba.BambaRMSNormGated.__init__).parameters else 1


def _reference_layer(config):
    import torch
    from transformers.models.bamba.modeling_bamba import BambaMixer

    torch.manual_seed(0)
    layer = BambaMixer(config, 0).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name == "A_log":
                param.copy_(torch.rand(param.shape, generator=generator).log())
            elif name in ("dt_bias", "norm.weight", "D"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    return layer


def _load(path, fault):
    return gdn_layer_check.load_code(path, "mamba2_under_check", [FAULTS[fault]] if fault else ())


def check(job):
    import torch

    dtype = getattr(torch, job.get("dtype", "float32"))
    config = _config(job.get("groups") or _grouped_norm_groups())
    reference = _reference_layer(config)
    rounded = _reference_layer(config).to(dtype)
    module = _load(CODE, job.get("fault"))
    infer_config = SimpleNamespace(parallel_config=SimpleNamespace(attn_tp_size=1),
                                   model_config=SimpleNamespace(exe_mode="eager"))
    torch.set_default_dtype(dtype)
    try:
        layer = module.ModelMamba2Mixer(config, infer_config, None, 0, prefix="model.layers.0.mamba").eval()
    finally:
        torch.set_default_dtype(torch.float32)
    params = dict(layer.named_parameters())
    for name, tensor in reference.state_dict().items():
        param = params.pop(name)
        getattr(param, "weight_loader", lambda p, w: p.data.copy_(w))(param, tensor.to(param.dtype))
    assert not params, sorted(params)
    return gdn_layer_check.drive(layer, reference, rounded, config.hidden_size, dtype, LENGTHS, DECODE_STEPS,
                                 fill=float("nan"))


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)        # tiny tensors: thread start-up on a shared host costs more than the arithmetic
    print("CHECK " + json.dumps([check(job) for job in json.loads(sys.argv[1])]))
