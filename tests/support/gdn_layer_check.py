"""The generated Gated DeltaNet layer (agent/recipe/native/parts/code/linear_attention_gdn.py) against transformers'
on a tiny config, as the executor drives it: `python tests/support/gdn_layer_check.py JSON` under the npu stand-in,
a cann-recipes-infer checkout on sys.path. JSON: a list of jobs {"model_type", "dtype", "fault"}. A packed prefill of prompts of
unequal length (one shorter than the conv's history), then decode steps, each request's conv and recurrent state in
its block of the Mamba cache (block 0, no request's, holds NaN); each step's outputs against transformers' layer on
the whole sequence so far (no cache: its own chunked rule from zero state). Prints one line: CHECK [{"ok", "max_rel",
"step"} per job].

Faults (a planted error in the layer's arithmetic or its state handling): "conv_state" (decode forgets the conv
history), "recurrent_state" (decode starts from a zero state), "decay" (g's sign flipped), "shards" (q's and k's rows
of the tensors stored apart swapped at load: olmo_hybrid), "in_proj" (the stored in_proj's b and a read the other way
round: lara_mini). Types: qwen3_next, qwen3_5_text, lara_mini, olmo_hybrid (loaded from their checkpoint names as the
file's loader reads them: `stored`); a job's "sizes" override the tiny config's widths."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

LENGTHS = (13, 6, 2)
DECODE_STEPS = 4
TOLERANCE = 1e-4           # float32 against float32, relative to the largest output
RUN_DTYPE_SLACK = 2.0      # agent.recipe.native.selfcheck's
CODE = Path(__file__).resolve().parents[2] / "agent" / "recipe" / "native" / "parts" / "code" / "linear_attention_gdn.py"


def _config(model_type, sizes=None):
    from transformers import AutoConfig

    text = {"qwen3_next": "qwen3_next", "qwen3_5_text": "qwen3_5_text", "lara_mini": "lara_mini",
            "olmo_hybrid": "olmo_hybrid"}[model_type]
    return AutoConfig.for_model(text, **{**dict(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
                                linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], vocab_size=64),
                                         **(sizes or {})})


def _reference_layer(model_type, config):
    import torch

    if model_type == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet as Layer
    elif model_type == "lara_mini":
        from transformers.models.lara_mini.modeling_lara_mini import LaraMiniGatedDeltaNet as Layer
    elif model_type == "olmo_hybrid":
        from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridGatedDeltaNet as Layer
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet as Layer
    torch.manual_seed(0)
    layer = Layer(config, 0).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name == "A_log":
                param.copy_(torch.rand(param.shape, generator=generator).log())       # decays in (0, 1) per step
            elif name in ("dt_bias", "norm.weight", "o_norm.weight"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    return layer


LAYOUTS = {"qwen3_next": "qkvz_ba", "lara_mini": "in_proj", "olmo_hybrid": "q_k_v_g_b_a"}
OLMO_NAMES = {"g_proj": "in_proj_z", "b_proj": "in_proj_b", "a_proj": "in_proj_a", "o_proj": "out_proj", "o_norm": "norm"}


def stored(model_type, state):
    """(the file's parameter, tensor, shard) as its loader takes a checkpoint of `state`: lara_mini's in_proj
    stored whole; olmo_hybrid's q/k/v projections and conv kernels stored apart, its other names the file's."""
    if model_type == "lara_mini":
        parts = [state.pop(f"in_proj_{x}.weight") for x in ("qkv", "z", "b", "a")]
        state["in_proj.weight"] = __import__("torch").cat(parts)
    for name, tensor in state.items():
        module = name.split(".")[0]
        if model_type == "olmo_hybrid" and module in ("q_proj", "k_proj", "v_proj"):
            yield "merged_qkv_proj.weight", tensor, module[0]
        elif model_type == "olmo_hybrid" and module == "conv1d":
            key_dim = (tensor.shape[0] - state["v_proj.weight"].shape[0]) // 2
            for shard, rows in zip("qkv", tensor.split([key_dim, key_dim, tensor.shape[0] - 2 * key_dim])):
                yield "conv1d.weight", rows, shard
        else:
            yield (OLMO_NAMES.get(module, module) + name[len(module):] if model_type == "olmo_hybrid" else name), \
                tensor, None


def load_code(path, name, edits=(), siblings=()):
    """The code file at `path` as the assembler inlines it, as module `name`: the Gated DeltaNet file's helpers and
    `siblings`' (the other code files it imports from) defined before it in one namespace, its relative imports
    dropped; each of `edits` (old, new: a fault) replaced where it occurs once in the file itself."""
    source = path.read_text()
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    before = [sibling for sibling in (CODE, *siblings) if sibling != path]
    for file, text in [(sibling, sibling.read_text()) for sibling in before] + [(path, source)]:
        text = re.sub(r"^from \.\w+ import .*\n", "", text, flags=re.MULTILINE)
        exec(compile(text, str(file), "exec"), module.__dict__)
    return module


FAULTS = {
    "conv_state": [("self.conv_state.index_select(0, blocks)", "torch.zeros_like(self.conv_state.index_select(0, blocks))")],
    # decode from a zero state, on both paths (the NPU op's and float32's)
    "recurrent_state": [("scale=self.scale, actual_seq_lengths=torch.ones_like",
                         "scale=self.scale, actual_seq_lengths=self.recurrent_state.zero_() is None or torch.ones_like"),
                        ("if is_prefill else self.recurrent_state.index_select(0, blocks))", "if True else None)")],
    # the prefill's conv history not zeroed before a request's first token (a prompt shorter than the history reads
    # the request before it): write_conv_history, which the other linear-attention files share
    "history": [("history = (conv_inputs[index.clamp_min(0)] * inside)", "history = (conv_inputs[index.clamp_min(0)])")],
    "decay": [("g = -self.A_log", "g = self.A_log")],
    # q's and k's rows of a tensor stored apart swapped at load (olmo_hybrid's q/k/v and conv kernels)
    "shards": [('offset = {"q": 0, "k": rows,', 'offset = {"k": 0, "q": rows,')],
    # the stored in_proj's b and a rows read the other way round (lara_mini)
    "in_proj": [("mixed, z, b, a = self.in_proj(", "mixed, z, a, b = self.in_proj(")],
}


def check(job):
    import torch

    dtype = getattr(torch, job.get("dtype", "float32"))
    model_type = job["model_type"]
    config = _config(model_type, job.get("sizes"))
    reference = _reference_layer(model_type, config)
    rounded = _reference_layer(model_type, config).to(dtype)
    module = load_code(CODE, "gdn_under_check", FAULTS.get(job.get("fault"), ()))
    module.GDN_PROJECTIONS = LAYOUTS.get(model_type, "qkv_z_b_a")
    if model_type == "olmo_hybrid":
        # as the part sets them (agent.recipe.native.parts.linear_attention): q/k/v stored apart, beta up to 2, the
        # gated norm's fixed epsilon
        module.CONV_SHARDS, module.NEG_EIGVAL_KEY, module.GATED_NORM_EPS = True, "linear_allow_neg_eigval", 1e-5
    infer_config = SimpleNamespace(parallel_config=SimpleNamespace(attn_tp_size=1),
                                   model_config=SimpleNamespace(exe_mode="eager"))
    torch.set_default_dtype(dtype)
    try:
        layer = module.ModelGatedDeltaNet(config, infer_config, None, 0, prefix="model.layers.0.linear_attn").eval()
    finally:
        torch.set_default_dtype(torch.float32)
    params, loaded = dict(layer.named_parameters()), set()
    for name, tensor, shard in stored(model_type, reference.state_dict()):
        param = params[name]
        loader = getattr(param, "weight_loader", lambda p, w: p.data.copy_(w))
        loader(param, tensor.to(param.dtype), *([shard] if shard else []))
        loaded.add(name)
    assert not set(params) - loaded, sorted(set(params) - loaded)
    return drive(layer, reference, rounded, config.hidden_size, dtype)


def drive(layer, reference, rounded, hidden_size, dtype, lengths=LENGTHS, decode_steps=DECODE_STEPS, run_dtype_steps=2,
          fill=0.0, call=None):
    """`layer` (the file's, its weights loaded) as the executor drives it against transformers' `reference` (and
    `rounded`, the reference in the run dtype): a packed prefill of `lengths`, then `decode_steps` decode steps
    (`run_dtype_steps` in a run dtype other than float32), each request's states in its block of the Mamba cache (the
    cache starts as `fill`; block 0, no request's, holds NaN before every step); {"ok", "max_rel", "step"}.
    `call(model, x)`: a reference's output [T, hidden] for one sequence x [1, T, hidden] (its first output's row)."""
    import torch

    from agent.precision_rule import tolerance
    from executor.utils.forward_metadata import ForwardMetaData

    for sub in layer.modules():
        if getattr(sub, "quant_method", None) is not None:
            sub.quant_method.process_weights_after_loading(sub, is_nz=False)
    blocks = len(lengths) + 2
    caches = []
    for entry in layer.cache_entries:
        assert entry.attn_type == "Mamba" and entry.block_size == 1
        caches.append(torch.full((blocks, *entry.shape), fill, dtype=entry.dtype))
        entry.tensor_setter(caches[-1])
    table = torch.tensor([[row + 2] for row in range(len(lengths))], dtype=torch.int32)   # blocks 2, 3, 4
    generator = torch.Generator().manual_seed(5)
    sequences = [torch.randn(n, hidden_size, generator=generator) for n in lengths]
    call = call or (lambda model, x: model(x)[0])

    def expected(model, row):
        with torch.no_grad():
            return call(model, sequences[row][None].to(next(model.parameters()).dtype)).float()

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

    for cache in caches:
        cache[0] = float("nan")
    prompt = torch.tensor(lengths, dtype=torch.int64)
    meta = ForwardMetaData(is_prefill=True, actual_seq_lengths_q=prompt, actual_seq_lengths_kv=prompt,
                           actual_seq_lengths_cu_q=prompt.cumsum(0), prompt_tokens=int(prompt.sum()),
                           block_table={"Mamba": table}, attention_mask=None, slot_mapping={})
    with torch.no_grad():
        out = layer(torch.cat(sequences).to(dtype), meta).float()
    per_row = out.split(list(lengths))
    failed = compare("prefill", per_row, [(row, slice(None)) for row in range(len(lengths))])
    if failed:
        return failed
    rows = len(lengths)
    for step in range(decode_steps if dtype == torch.float32 else run_dtype_steps):
        new = torch.randn(rows, hidden_size, generator=generator)
        sequences[:] = [torch.cat([seq, new[row:row + 1]]) for row, seq in enumerate(sequences)]
        seen = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
        meta = ForwardMetaData(is_prefill=False, actual_seq_lengths_q=torch.ones(rows, dtype=torch.int64),
                               actual_seq_lengths_kv=seen,
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


def run(jobs, snapshot, script=None):
    """The jobs' results, checked in a child process under the npu stand-in with `snapshot` (a cann-recipes-infer
    checkout) on sys.path (the tests' entry). `script`: the layer check that runs them (this file by default; the
    Mamba2 and short-conv checks print their answer the same way)."""
    import os
    import subprocess

    from npu_standin.environment import standin_env

    repo = Path(__file__).resolve().parents[2]
    env = standin_env("cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(snapshot), str(repo), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(script or __file__), json.dumps(jobs)], env=env, capture_output=True,
                          text=True, cwd=repo, timeout=600)
    line = next((l for l in done.stdout.splitlines() if l.startswith("CHECK ")), None)
    assert line is not None, done.stderr[-3000:]
    return json.loads(line[len("CHECK "):])


if __name__ == "__main__":
    print("CHECK " + json.dumps([check(job) for job in json.loads(sys.argv[1])]))
