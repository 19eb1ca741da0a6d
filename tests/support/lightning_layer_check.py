"""The generated lightning-attention layer (agent/recipe/native/parts/code/linear_attention_lightning.py) against
transformers' MiniMaxLightningAttention on a tiny config, as the executor drives it: `python
tests/support/lightning_layer_check.py JSON` under the npu stand-in, a cann-recipes-infer checkout on sys.path. JSON: a
list of jobs {"dtype", "fault", "layer"}. A packed prefill of prompts of unequal length (one longer than the file's
prefill block, set to 4 here), then decode steps, each request's recurrent state in its block of the Mamba cache (block
0, no request's, holds NaN); each step's outputs against transformers' layer on the whole sequence so far (no cache:
its own block form from zero state). "layer" (default 1 of 3) is the layer index: its decay's depth scale. Prints one
line: CHECK [{"ok", "max_rel", "step"} per job].

Faults (a planted error in the layer's arithmetic or its state handling): "state" (decode starts from a zero state),
"depth" (the decay not scaled by the layer's depth), "gate" (the output gate not through its sigmoid), "block" (the
prefill's state carried to the next block undecayed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import gdn_layer_check  # its driver, beside this file

LENGTHS = (11, 5, 2)
DECODE_STEPS = 3
BLOCK = 4                  # the file's prefill block, shrunk: the 11-token prompt crosses two block boundaries
PARTS = Path(__file__).resolve().parents[2] / "agent" / "recipe" / "native" / "parts" / "code"
CODE = PARTS / "linear_attention_lightning.py"
FAULTS = {
    "state": ("self.recurrent_state.index_select(0, blocks) * torch.exp",
              "torch.zeros_like(self.recurrent_state.index_select(0, blocks)) * torch.exp"),
    "depth": ("factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5", "factor = 1.0"),
    "gate": ("torch.sigmoid(self.output_gate(hidden_states))", "self.output_gate(hidden_states)"),
    "block": ("state = state * torch.exp(-decay * size) +", "state = state +"),
}


def _load(fault):
    """The code file as the assembler inlines it: the Gated DeltaNet file's helpers it imports defined before it."""
    module = gdn_layer_check.load_code(CODE, "lightning_under_check", [FAULTS[fault]] if fault else ())
    module.LIGHTNING_BLOCK = BLOCK
    module.lightning_prefill.__defaults__ = (BLOCK,)
    return module


def _reference(config, layer):
    import torch
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    module = MiniMaxLightningAttention(config, layer).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in module.named_parameters():
            scale = 0.3 if name != "norm.weight" else 1.0
            param.copy_((1.0 if name == "norm.weight" else 0.0) + torch.randn(param.shape, generator=generator) * scale)
    return module


def check(job):
    import torch
    from transformers import AutoConfig

    dtype = getattr(torch, job.get("dtype", "float32"))
    index = job.get("layer", 1)
    config = AutoConfig.for_model("minimax", hidden_size=32, num_attention_heads=4, head_dim=8, num_hidden_layers=3,
                                  layer_types=["linear_attention"] * 3, block_size=4, vocab_size=64)
    reference = _reference(config, index)
    rounded = _reference(config, index).to(dtype)
    module = _load(job.get("fault"))
    infer_config = SimpleNamespace(parallel_config=SimpleNamespace(attn_tp_size=1))
    torch.set_default_dtype(dtype)
    try:
        layer = module.ModelLightningAttention(config, infer_config, None, index,
                                               prefix=f"model.layers.{index}.linear_attn").eval()
    finally:
        torch.set_default_dtype(torch.float32)
    params = dict(layer.named_parameters())
    weights = dict(reference.named_parameters())        # its slope_rate and decay buffers: the file computes them
    assert set(params) == set(weights), (sorted(params), sorted(weights))
    for name, tensor in weights.items():
        params[name].data.copy_(tensor.detach().to(params[name].dtype))
    (entry,) = layer.cache_entries
    assert entry.dtype == torch.float32
    return gdn_layer_check.drive(layer, reference, rounded, config.hidden_size, dtype, LENGTHS, DECODE_STEPS,
                                 run_dtype_steps=DECODE_STEPS,
                                 call=lambda model, x: model(x, position_embeddings=None, attention_mask=None)[0][0])


if __name__ == "__main__":
    print("CHECK " + json.dumps([check(job) for job in json.loads(sys.argv[1])]))
