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

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

LENGTHS = (11, 5, 2)
DECODE_STEPS = 3
BLOCK = 4                  # the file's prefill block, shrunk: the 11-token prompt crosses two block boundaries
TOLERANCE = 1e-4           # float32 against float32, relative to the largest output
RUN_DTYPE_SLACK = 2.0      # agent.recipe.native.selfcheck's
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
    source = CODE.read_text()
    if fault:
        old, new = FAULTS[fault]
        assert source.count(old) == 1, fault
        source = source.replace(old, new)
    source = source.replace("from .linear_attention_gdn import MAMBA, mamba_cache_entries\n", "")
    spec = importlib.util.spec_from_loader("lightning_under_check", loader=None)
    module = importlib.util.module_from_spec(spec)
    gdn = (PARTS / "linear_attention_gdn.py").read_text()
    exec(compile(gdn, str(PARTS / "linear_attention_gdn.py"), "exec"), module.__dict__)
    exec(compile(source, str(CODE), "exec"), module.__dict__)
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

    from agent.precision_rule import tolerance
    from executor.utils.forward_metadata import ForwardMetaData

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
    for sub in layer.modules():
        if getattr(sub, "quant_method", None) is not None:
            sub.quant_method.process_weights_after_loading(sub, is_nz=False)
    (entry,) = layer.cache_entries
    assert entry.attn_type == "Mamba" and entry.block_size == 1 and entry.dtype == torch.float32
    cache = torch.zeros(len(LENGTHS) + 2, *entry.shape, dtype=entry.dtype)
    entry.tensor_setter(cache)
    table = torch.tensor([[row + 2] for row in range(len(LENGTHS))], dtype=torch.int32)   # blocks 2, 3, 4
    generator = torch.Generator().manual_seed(5)
    sequences = [torch.randn(n, config.hidden_size, generator=generator) for n in LENGTHS]

    def expected(model, row):
        with torch.no_grad():
            x = sequences[row][None].to(next(model.parameters()).dtype)
            return model(x, position_embeddings=None, attention_mask=None)[0][0].float()

    worst = {"rel": 0.0}

    def compare(step, got, rows_tokens):
        for row, tokens in rows_tokens:
            want = expected(reference, row)[tokens]
            error, scale = float((got[row] - want).abs().max()), float(want.abs().max())
            if dtype == torch.float32:
                allowed = TOLERANCE * scale
            else:       # the precision verdict's rule, as the self-check holds the run dtype
                own = float((expected(rounded, row)[tokens] - want).abs().max())
                allowed = RUN_DTYPE_SLACK * tolerance(own, scale, "bfloat16")
            worst["rel"] = max(worst["rel"], error / scale)
            if not error <= allowed:
                return {"ok": False, "max_rel": error / scale, "step": step, "row": row}
        return None

    cache[0] = float("nan")
    lengths = torch.tensor(LENGTHS, dtype=torch.int64)
    meta = ForwardMetaData(is_prefill=True, actual_seq_lengths_q=lengths, actual_seq_lengths_kv=lengths,
                           actual_seq_lengths_cu_q=lengths.cumsum(0), prompt_tokens=int(lengths.sum()),
                           block_table={"Mamba": table}, attention_mask=None, slot_mapping={})
    with torch.no_grad():
        out = layer(torch.cat(sequences).to(dtype), meta).float()
    failed = compare("prefill", out.split(list(LENGTHS)), [(row, slice(None)) for row in range(len(LENGTHS))])
    if failed:
        return failed
    rows = len(LENGTHS)
    for step in range(DECODE_STEPS):
        new = torch.randn(rows, config.hidden_size, generator=generator)
        sequences[:] = [torch.cat([seq, new[row:row + 1]]) for row, seq in enumerate(sequences)]
        lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
        meta = ForwardMetaData(is_prefill=False, actual_seq_lengths_q=torch.ones(rows, dtype=torch.int64),
                               actual_seq_lengths_kv=lengths,
                               actual_seq_lengths_cu_q=torch.arange(1, rows + 1, dtype=torch.int64),
                               block_table={"Mamba": table}, attention_mask=None, slot_mapping={})
        cache[0] = float("nan")
        with torch.no_grad():
            out = layer(new.to(dtype), meta).float()
        failed = compare(f"decode step {step + 1}", out[:, None], [(row, slice(-1, None)) for row in range(rows)])
        if failed:
            return failed
    return {"ok": True, "max_rel": worst["rel"], "step": None}


if __name__ == "__main__":
    print("CHECK " + json.dumps([check(job) for job in json.loads(sys.argv[1])]))
