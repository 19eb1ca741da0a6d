"""torch_npu ops per decode step: the stand-in's per-step, per-layer record (npu_standin.record,
marked at upstream's ModelWorker.inference by npu_standin.steps) and scripts/op_table.py, which puts
upstream's own models/qwen and our framework model of one tiny Qwen3 checkpoint side by side."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from locations import REPO_ROOT
from npu_standin import read_op_usage, standin_env

SCRIPT = REPO_ROOT / "scripts" / "op_table.py"


def op_table():
    spec = importlib.util.spec_from_file_location("op_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A stand-in for upstream's executor module, in its own import path: a worker whose model has three
# decoder layers (one npu_rms_norm each, two in a prefill) and a final norm outside them.
WORKER = '''
import types
import torch
import torch_npu

class Layer(torch.nn.Module):
    def forward(self, x, is_prefill):
        for _ in range(2 if is_prefill else 1):
            x = torch_npu.npu_rms_norm(x, torch.ones(x.shape[-1]))[0]
        return x

class TinyForCausalLM(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.config = types.SimpleNamespace(num_hidden_layers=layers)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(layers))
    def forward(self, x, is_prefill):
        for layer in self.layers:
            x = layer(x, is_prefill)
        return torch_npu.npu_rms_norm(x, torch.ones(x.shape[-1]))[0]

class ModelWorker:
    def __init__(self, layers, exe_mode):
        self.model = TinyForCausalLM(layers)
        self.hf_config = types.SimpleNamespace(num_hidden_layers=layers)
        self.exe_mode = exe_mode
        self.model_compiled = None
    def inference(self, model_inputs, is_prefill, is_mtp=False):
        if self.exe_mode == "npugraph_ex" and not is_prefill:   # as upstream: compiled at the warm-up's decode
            if self.model_compiled is None:
                self.model_compiled = torch.compile(self.model, backend="npugraph_ex", fullgraph=True, dynamic=False)
            return self.model_compiled(model_inputs["x"], False), 0.0
        return self.model(model_inputs["x"], is_prefill), 0.0
'''

DRIVER = '''
import types
import torch
import sys
from executor.core.model_worker.model_worker import ModelWorker

worker = ModelWorker(3, sys.argv[1])
x, ids = torch.randn(2, 8), torch.tensor([1, 2])
warm = types.SimpleNamespace(is_warm_up=True)
worker.inference({"x": x, "input_ids": ids, "forward_metadata": warm}, True)
worker.inference({"x": x, "input_ids": ids, "forward_metadata": warm}, False)
out, _ = worker.inference({"x": x, "input_ids": ids, "forward_metadata": types.SimpleNamespace(is_warm_up=False)}, True)
for _ in range(4):
    out, _ = worker.inference({"x": x, "input_ids": ids}, False)
worker.inference({"x": x, "input_ids": ids}, False, is_mtp=True)
assert out.shape == (2, 8)
print("ok")
'''


@pytest.mark.parametrize("exe_mode", ["eager", "npugraph_ex"])
def test_record_counts_each_step_and_layer_without_warm_up_or_mtp(tmp_path, exe_mode):
    """With the precision probe in the same process (every trial run has it, its sitecustomize first on
    PYTHONPATH): both hooks on ModelWorker see every call, and neither's layer hooks make the compiled
    decode recompile. A compiled decode step's calls are counted as its graph runs them, none per layer."""
    from agent.measure.precision import probe_env

    package = tmp_path / "executor" / "core" / "model_worker"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "model_worker.py").write_text(WORKER)
    (tmp_path / "driver.py").write_text(textwrap.dedent(DRIVER))
    records = tmp_path / "records"
    env = probe_env(standin_env("cpu", record_dir=records), tmp_path / "run")
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{tmp_path}"
    env["NPU_STANDIN_COMPILE"] = "capture"
    proc = subprocess.run([sys.executable, "driver.py", exe_mode], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
    # the probe recorded the prefill and the four decode steps
    assert len(list((tmp_path / "run" / "precision" / "rank_0").glob("call_*.pt"))) == 5
    usage = read_op_usage(records)
    # the process total still counts every call: 2 warm-up, 1 prefill, 4 decode, 1 MTP
    assert usage["ops"] == {"npu_rms_norm": 7 + 4 + 7 + 4 * 4 + 4}
    (process,) = usage["per_process"]
    assert process["steps_excluded"] == {"mtp": 1, "warm-up": 2}
    prefill, decode = process["steps"]
    assert prefill == {"phase": "prefill", "steps": [1], "exe_mode": exe_mode, "compiled": False, "layers": 3,
                       "ops": {"npu_rms_norm": 7}, "per_layer": {"npu_rms_norm": [2, 2, 2]},
                       "outside_layers": {"npu_rms_norm": 1}}
    assert decode["steps"] == [1, 2, 3, 4] and decode["ops"] == {"npu_rms_norm": 4}
    table = op_table().build_table([{"label": "a", "model": "m", "yaml": "y.yaml", "usage": usage, "returncode": 0}])
    (row,) = table["rows"]
    assert row["op"] == "npu_rms_norm" and row["cells"]["a"]["calls_per_decode_step"] == "4"
    if exe_mode == "eager":
        assert decode["per_layer"] == {"npu_rms_norm": [1, 1, 1]} and decode["outside_layers"] == {"npu_rms_norm": 1}
        assert row["cells"]["a"]["per_layer"] == "1 + 1 outside layers"
        return
    assert decode["compiled"] is True and decode["layers"] is None and "per_layer" not in decode
    assert row["cells"]["a"]["per_layer"] == "n/a (compiled step)"
    (entry,) = usage["compiles"].values()
    assert entry["compiles"] == 1 and entry["recompiles"] == 0, usage["compiles"]


def _usage(decode_groups: list[dict], rank: int = 0) -> dict:
    return {"per_process": [{"rank": rank, "steps": decode_groups, "steps_excluded": {"warm-up": 2}}]}


def test_table_has_a_row_for_every_op_of_either_side_and_the_callers_explanations():
    module = op_table()
    upstream = _usage([{"phase": "decode", "steps": [1, 2], "exe_mode": "eager", "compiled": False, "layers": 2,
                        "ops": {"npu_rms_norm": 5, "npu_swiglu": 2},
                        "per_layer": {"npu_rms_norm": [3, 2], "npu_swiglu": [1, 1]},
                        "outside_layers": {"npu_rms_norm": 0, "npu_swiglu": 0}}])
    ours = _usage([{"phase": "decode", "steps": [1], "exe_mode": "npugraph_ex", "compiled": True, "layers": None,
                    "ops": {"npu_rms_norm": 5, "npu_mm_all_reduce_base": 1}},
                   {"phase": "decode", "steps": [2], "exe_mode": "npugraph_ex", "compiled": True, "layers": None,
                    "ops": {"npu_rms_norm": 6, "npu_mm_all_reduce_base": 1}}])
    table = module.build_table([{"label": "up", "model": "qwen", "yaml": "q.yaml", "usage": upstream},
                                {"label": "ours", "model": "o", "yaml": "o.yaml", "usage": ours},
                                {"label": "failed", "model": "f", "yaml": "f.yaml", "usage": None, "returncode": 1}],
                               explanations={"npu_swiglu": "ours keeps the activation in torch"})
    rows = {row["op"]: row for row in table["rows"]}
    assert sorted(rows) == ["npu_mm_all_reduce_base", "npu_rms_norm", "npu_swiglu"]
    assert rows["npu_rms_norm"]["cells"]["up"] == {"calls_per_decode_step": "5", "calls": [5, 5],
                                                   "per_layer": "[3,2]"}
    # decode steps that differ show the range; a compiled step has no per-layer split
    assert rows["npu_rms_norm"]["cells"]["ours"]["calls_per_decode_step"] == "5–6"
    assert rows["npu_rms_norm"]["cells"]["ours"]["per_layer"] == "n/a (compiled step)"
    assert rows["npu_swiglu"]["cells"]["ours"]["calls_per_decode_step"] == "—"
    assert rows["npu_swiglu"]["difference"] == "ours keeps the activation in torch"
    assert rows["npu_mm_all_reduce_base"]["difference"] == "only in ours"
    text = module.markdown(table)
    assert "| `npu_swiglu` | 2 | 1 | — | — | run failed | run failed | ours keeps the activation in torch |" in text
    assert "failed: no steps in the stand-in's record (launcher exit 1" in text
    assert "ours: models/o with o.yaml, exe_mode npugraph_ex (decode compiled" in text
    # an explanation of a difference is not shown on a row whose counts are the same on both sides
    same = module.build_table([{"label": "up", "model": "qwen", "yaml": "q.yaml", "usage": upstream},
                               {"label": "again", "model": "qwen", "yaml": "q.yaml", "usage": upstream}],
                              explanations={"npu_swiglu": "ours keeps the activation in torch"})
    assert {row["op"]: (row["same"], row["difference"]) for row in same["rows"]} == \
        {"npu_rms_norm": (True, ""), "npu_swiglu": (True, "")}
    assert "| `npu_swiglu` | 2 | 1 | 2 | 1 | same |" in module.markdown(same)


def test_op_table_of_upstreams_qwen_and_ours_on_one_tiny_qwen3(tmp_path):
    module = op_table()
    if not (module.DEFAULT_CHECKOUT / "executor").is_dir():
        pytest.skip(f"no upstream snapshot at {module.DEFAULT_CHECKOUT} (../shared is absent)")
    layers = 3
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model-type", "qwen3", "--num-layers", str(layers),
                           "--upstream", "qwen:qwen3_8b_1tp.yaml", "--max-new-tokens", "3", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    table = json.loads((tmp_path / "op_table.json").read_text())
    up, ours = table["columns"]
    assert up["label"] == "upstream qwen" and ours["label"] == "ours"
    counts = up["counts"]
    assert counts["layers"] == layers and counts["exe_mode"] == "eager" and not counts["compiled"]
    assert counts["decode_steps"] >= 2 and counts["excluded"] == {"warm-up": 2}
    assert ours["counts"] and ours["counts"]["decode_steps"] == counts["decode_steps"]

    def in_layers(name):
        (per_layer,) = counts["per_layer"][name]          # every decode step the same
        return sum(per_layer)

    for name in ("npu_fused_infer_attention_score_v2", "npu_scatter_nd_update_", "npu_apply_rotary_pos_emb"):
        calls = counts["decode"][name]
        assert calls and len(set(calls)) == 1, (name, calls)
        assert counts["per_layer"][name] == [[calls[0] // layers] * layers], (name, counts["per_layer"][name])
        assert calls[0] % layers == 0 and calls[0] == in_layers(name)
    norms = in_layers("npu_rms_norm") + in_layers("npu_add_rms_norm")
    assert norms > 0 and norms % layers == 0
    text = (tmp_path / "op_table.md").read_text()
    for row in table["rows"]:
        assert f"| `{row['op']}` |" in text
    assert f"upstream qwen: per layer (×{layers})" in text
