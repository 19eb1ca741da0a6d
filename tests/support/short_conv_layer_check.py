"""The generated short-convolution layer (agent/recipe/native/parts/code/short_conv.py) against transformers' lfm2
Lfm2ShortConv on a tiny config, as the executor drives it: `python tests/support/short_conv_layer_check.py JSON`
under the npu stand-in, a cann-recipes-infer checkout on sys.path. JSON: a list of jobs {"dtype", "fault"}. A packed
prefill of prompts of unequal length (one shorter than the conv's history), then decode steps, each request's conv
state in its block of the Mamba cache (block 0, no request's, holds NaN); each step's outputs against transformers'
layer on the whole sequence so far (no cache). Prints one line: CHECK [{"ok", "max_rel", "step"} per job].

Faults (a planted error in the layer's arithmetic or its state handling): "conv_state" (decode forgets the conv
history), "gates" (B and C read the other way round), "taps" (the prefill's conv kernel read back to front)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

LENGTHS = (7, 4, 1)
DECODE_STEPS = 3
TOLERANCE = 1e-4           # float32 against float32, relative to the largest output
RUN_DTYPE_SLACK = 2.0      # agent.recipe.native.selfcheck's
CODE = Path(__file__).resolve().parents[2] / "agent" / "recipe" / "native" / "parts" / "code" / "short_conv.py"
FAULTS = {
    "conv_state": ("self.conv_state.index_select(0, blocks)", "torch.zeros_like(self.conv_state.index_select(0, blocks))"),
    "gates": ("gate_b, gate_c, x = self.in_proj(", "gate_c, gate_b, x = self.in_proj("),
    "taps": ("weight[:, kernel - 1 - shift]", "weight[:, shift]"),
}


def _load(fault):
    source = CODE.read_text()
    if fault:
        old, new = FAULTS[fault]
        assert source.count(old) == 1, fault
        source = source.replace(old, new)
    spec = importlib.util.spec_from_loader("short_conv_under_check", loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, str(CODE), "exec"), module.__dict__)
    return module


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

    from agent.precision_rule import tolerance
    from executor.utils.forward_metadata import ForwardMetaData

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
    for sub in layer.modules():
        if getattr(sub, "quant_method", None) is not None:
            sub.quant_method.process_weights_after_loading(sub, is_nz=False)
    (entry,) = layer.cache_entries
    assert entry.attn_type == "Mamba" and entry.block_size == 1
    cache = torch.zeros(len(LENGTHS) + 2, *entry.shape, dtype=entry.dtype)
    entry.tensor_setter(cache)
    table = torch.tensor([[row + 2] for row in range(len(LENGTHS))], dtype=torch.int32)   # blocks 2, 3, 4
    generator = torch.Generator().manual_seed(5)
    sequences = [torch.randn(n, config.hidden_size, generator=generator) for n in LENGTHS]

    def expected(model, row):
        with torch.no_grad():
            return model(sequences[row][None].to(next(model.parameters()).dtype))[0].float()

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
