"""The generated Mamba1 mixer (agent/recipe/native/parts/code/linear_attention_mamba1.py) against transformers' own
mixer (JambaMambaMixer, MambaMixer, FalconMambaMixer) on a tiny config, as the executor drives it:
`python tests/support/mamba1_layer_check.py JSON` under the npu stand-in, a cann-recipes-infer checkout on sys.path.
JSON: a list of jobs {"family" (jamba, mamba, falcon_mamba), "dtype", "fault"}; the code's options set as the Mamba1
part sets them for the family. A packed prefill of prompts of unequal length (one shorter than the conv's history),
then decode steps, each request's conv and ssm state in its block of the Mamba cache; every block is NaN before the
prefill and block 0, no request's, is NaN before each step. Each step's outputs are held to transformers' mixer run
on the whole sequence so far (no cache). Prints one line: CHECK [{"ok", "max_rel", "step"} per job].

Faults (a planted error in the mixer's arithmetic or its state handling): "conv_state" (decode forgets the conv
history), "ssm_state" (decode starts from a zero ssm state), "skip" (the D x skip dropped), "dt_norm" (dt, B and C
left un-normed)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import mamba2_layer_check

LENGTHS = (9, 5, 2)
DECODE_STEPS = 3
TOLERANCE = 1e-4           # float32 against float32, relative to the largest output
RUN_DTYPE_SLACK = 2.0      # agent.recipe.native.selfcheck's
CODE_DIR = Path(__file__).resolve().parents[2] / "agent" / "recipe" / "native" / "parts" / "code"
SIBLING = "from .linear_attention_mamba2 import mamba_conv1d_packed, mamba_conv1d_update\n"
FAULTS = {
    "conv_state": ("self.conv_state.index_select(0, blocks), weight",
                   "torch.zeros_like(self.conv_state.index_select(0, blocks)), weight"),
    "ssm_state": ("state = self.ssm_state.index_select(0, blocks).float()",
                  "state = torch.zeros_like(self.ssm_state.index_select(0, blocks)).float()"),
    "skip": (" + D * x[t]", ""),
    "dt_norm": ("dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)", "pass"),
}


def family_options(family):
    """The code's options for a family, as agent.recipe.native.parts.linear_attention_mamba1 reads them."""
    from agent.recipe.native.parts.linear_attention_mamba1 import KEYS

    keys = KEYS["mamba" if family == "falcon_mamba" else family]
    norm = {"jamba": ("weighted", "rms_norm_eps"), "mamba": (None, "rms_norm_eps"),
            "falcon_mamba": ("weightless", "mixer_rms_eps")}[family]
    return {**keys, "MAMBA1_DT_BC_NORM": norm[0], "MAMBA1_DT_BC_NORM_EPS": norm[1]}


def _config(family):
    from transformers import AutoConfig

    if family == "jamba":
        return AutoConfig.for_model("jamba", hidden_size=32, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                                    mamba_dt_rank=6, num_hidden_layers=1, vocab_size=64, use_mamba_kernels=False)
    return AutoConfig.for_model(family, hidden_size=32, state_size=8, conv_kernel=4, intermediate_size=64,
                                time_step_rank=6, num_hidden_layers=1, vocab_size=64)


def _reference_layer(config):
    import torch
    from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaMixer
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer
    from transformers.models.mamba.modeling_mamba import MambaMixer

    torch.manual_seed(0)
    mixer = {"jamba": JambaMambaMixer, "mamba": MambaMixer, "falcon_mamba": FalconMambaMixer}[config.model_type]
    # the blocks build their mixer without its own init (falcon_mamba's inits norms it does not hold)
    extra = {} if config.model_type == "jamba" else {"initialize_mixer_weights": False}
    layer = mixer(config, 0, **extra).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name == "A_log":
                param.copy_(torch.rand(param.shape, generator=generator).log())
            elif name in ("dt_proj.bias", "D") or name.endswith("layernorm.weight"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return layer


def _load(fault, options):
    source = (CODE_DIR / "linear_attention_mamba1.py").read_text()
    assert source.count(SIBLING) == 1
    source = source.replace(SIBLING, "")
    if fault:
        old, new = FAULTS[fault]
        assert source.count(old) == 1, fault
        source = source.replace(old, new)
    spec = importlib.util.spec_from_loader("mamba1_under_check", loader=None)
    module = importlib.util.module_from_spec(spec)
    sibling = mamba2_layer_check._load(mamba2_layer_check.CODE, None)
    module.__dict__.update(mamba_conv1d_packed=sibling.mamba_conv1d_packed,
                           mamba_conv1d_update=sibling.mamba_conv1d_update)
    exec(compile(source, str(CODE_DIR / "linear_attention_mamba1.py"), "exec"), module.__dict__)
    module.__dict__.update(options)
    return module


def check(job):
    import torch

    from agent.precision_rule import tolerance
    from executor.utils.forward_metadata import ForwardMetaData

    family = job.get("family", "jamba")
    dtype = getattr(torch, job.get("dtype", "float32"))
    config = _config(family)
    reference = _reference_layer(config)
    rounded = _reference_layer(config).to(dtype)
    module = _load(job.get("fault"), family_options(family))
    infer_config = SimpleNamespace(parallel_config=SimpleNamespace(attn_tp_size=1),
                                   model_config=SimpleNamespace(exe_mode="eager"))
    torch.set_default_dtype(dtype)
    try:
        layer = module.ModelMamba1Mixer(config, infer_config, None, 0, prefix="model.layers.0.mamba").eval()
    finally:
        torch.set_default_dtype(torch.float32)
    params = dict(layer.named_parameters())
    for name, tensor in reference.state_dict().items():
        param = params.pop(name)
        getattr(param, "weight_loader", lambda p, w: p.data.copy_(w))(param, tensor.to(param.dtype))
    assert not params, sorted(params)
    for sub in layer.modules():
        if getattr(sub, "quant_method", None) is not None:
            sub.quant_method.process_weights_after_loading(sub, is_nz=False)
    blocks = len(LENGTHS) + 2
    caches = []
    for entry in layer.cache_entries:
        assert entry.attn_type == "Mamba" and entry.block_size == 1
        caches.append(torch.full((blocks, *entry.shape), float("nan"), dtype=entry.dtype))
        entry.tensor_setter(caches[-1])
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
            error = float((got[row] - want).abs().max())
            scale = float(want.abs().max())
            if dtype == torch.float32:
                allowed = TOLERANCE * scale
            else:       # the precision verdict's rule, as the self-check holds the run dtype
                own = float((expected(rounded, row)[tokens] - want).abs().max())
                allowed = RUN_DTYPE_SLACK * tolerance(own, scale, "bfloat16")
            worst["rel"] = max(worst["rel"], error / scale)
            if not error <= allowed:
                return {"ok": False, "max_rel": error / scale, "step": step, "row": row}
        return None

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
    for step in range(DECODE_STEPS if dtype == torch.float32 else 2):
        new = torch.randn(rows, config.hidden_size, generator=generator)
        sequences[:] = [torch.cat([seq, new[row:row + 1]]) for row, seq in enumerate(sequences)]
        lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
        meta = ForwardMetaData(is_prefill=False, actual_seq_lengths_q=torch.ones(rows, dtype=torch.int64),
                               actual_seq_lengths_kv=lengths,
                               actual_seq_lengths_cu_q=torch.arange(1, rows + 1, dtype=torch.int64),
                               block_table={"Mamba": table}, attention_mask=None, slot_mapping={})
        for cache in caches:
            cache[0] = float("nan")
        with torch.no_grad():
            out = layer(new.to(dtype), meta).float()
        failed = compare(f"decode step {step + 1}", out[:, None], [(row, slice(-1, None)) for row in range(rows)])
        if failed:
            return failed
    return {"ok": True, "max_rel": worst["rel"], "step": None}


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)        # tiny tensors: thread start-up on a shared host costs more than the arithmetic
    print("CHECK " + json.dumps([check(job) for job in json.loads(sys.argv[1])]))
