"""Every torch callable the stand-in patches traces under torch.compile (dynamo) as torch's own does
(SPEC §8): capture_sweep.py calls each entry of npu_standin.patches.PATCHED — the one table every
replacement goes through, so a newly patched callable is covered or named here — eagerly and compiled
with fullgraph=True by plain torch.compile and by the stand-in's npugraph_ex backend, then a model of plain
nn.Linear / nn.Embedding / F.* layers (fp32, and bf16 with an fp32 gate) the same way.

A capture that fails under the stand-in is allowed only where torch itself cannot trace the same call
(the plain run: its eager call works and its compile fails — torch.load, sparse constructors, ...)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from npu_standin import read_op_usage, standin_env

SWEEP = Path(__file__).with_name("capture_sweep.py")
MUST_BE_PATCHED = {"torch.nn.functional.linear", "torch.matmul", "torch.Tensor.__matmul__", "torch.addmm",
                   "torch.Tensor.to", "torch.device", "torch.zeros"}


def run_sweep(tmp_path: Path, *, standin: bool, backend: str = "aot_eager", env: dict | None = None,
              name: str = "sweep") -> tuple[dict, dict]:
    records = tmp_path / f"{name}-records"
    base = {**os.environ, **(env or {})}
    run_env = standin_env("cpu", base=base, record_dir=records) if standin else base
    proc = subprocess.run([sys.executable, str(SWEEP), backend], capture_output=True, text=True, timeout=900,
                          env=run_env, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("CAPTURE-SWEEP ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].split(" ", 1)[1]), (read_op_usage(records) if standin else {})


def traced_like_torch(row: dict, plain: dict | None) -> str | None:
    """None where each compile of the example under the stand-in did what its eager call did; else why not."""
    eager = row["eager"]
    if not eager["ok"]:
        return None                 # the call itself fails on this host (pin_memory without an accelerator)
    for key in ("compile", "npugraph_ex"):
        got = row[key]
        if got["ok"] and got.get("same_as_eager", True):
            continue
        if not got["ok"] and plain is not None and plain["eager"]["ok"] and not plain["compile"]["ok"]:
            continue                # torch cannot trace its own callable here either
        what = got["error"] if not got["ok"] else f"a different result ({got['value']})"
        return f"{row['name']} ({row['label']}), {key}: {what}"
    return None


def capture_problems(standin: dict, plain_rows: dict[int, dict]) -> list[str]:
    """What is wrong with a sweep under the stand-in: patched callables without an example, examples that
    do not trace as torch's own do, a model whose compiled run fails or differs."""
    problems = []
    problems += [f"{name}: patched by the stand-in, no example in capture_sweep.py"
                 for name in standin["patched"] if name not in standin["covered"]]
    for row in standin["examples"]:
        why = traced_like_torch(row, plain_rows.get(row["index"]))
        if why:
            problems.append(why)
    for model, rows in standin.get("models", {}).items():
        for key in ("compile", "npugraph_ex"):
            got = rows[key]
            if not (got["ok"] and got["same_as_eager"] and got["all_ran"]):
                problems.append(f"model {model}, {key}: {got.get('error') or got}")
    return problems


def untraced_indices(standin: dict) -> list[int]:
    return [row["index"] for row in standin["examples"]
            if row["eager"]["ok"] and not (row["compile"]["ok"] and row["npugraph_ex"]["ok"])]


def test_every_patched_callable_and_a_plain_layer_model_capture_under_the_standin(tmp_path):
    standin, usage = run_sweep(tmp_path, standin=True, env={"NPU_STANDIN_COMPILE": "capture"})
    assert MUST_BE_PATCHED <= set(standin["patched"]), standin["patched"]
    failed = untraced_indices(standin)
    plain_rows = {}
    if failed:       # what torch itself makes of those calls, without the stand-in
        plain, _ = run_sweep(tmp_path, standin=False, env={"CAPTURE_SWEEP_ONLY": ",".join(map(str, failed))},
                             name="plain")
        plain_rows = {row["index"]: row for row in plain["examples"]}
    assert capture_problems(standin, plain_rows) == []
    # the mixed-dtype rules themselves are traced, not excused: the NPU takes these pairs, the host does not
    mixed = [row for row in standin["examples"] if "bf16 x fp32" in row["label"]]
    assert len(mixed) >= 10 and all(row["compile"]["ok"] and row["npugraph_ex"]["ok"] for row in mixed)
    excused = {plain_rows[i]["name"] for i in failed}
    assert excused.isdisjoint(MUST_BE_PATCHED), excused
    # decode-style capture of each model: one compile, no recompile over two lengths (dynamic=True)
    for model in ("PlainLayers", "MixedDtypeLayers"):
        entry = usage["compiles"][f"{model} [npugraph_ex]"]
        assert (entry["compiles"], entry["recompiles"], entry["fullgraph"]) == (1, 0, True), entry


def test_a_patched_callable_that_dynamo_cannot_trace_is_named(tmp_path):
    """The fault the F.linear patch was (its real looked up in a dict keyed by a module), on F.gelu, which
    the models call: the sweep names the new patch as having no example and both models as failing."""
    standin, _ = run_sweep(tmp_path, standin=True, env={"NPU_STANDIN_COMPILE": "capture", "CAPTURE_SWEEP_FAULT": "1",
                                                        "CAPTURE_SWEEP_MODELS_ONLY": "1"})
    problems = capture_problems(standin, {})
    assert [line for line in problems if "no example" in line] == [
        "torch.nn.functional.gelu: patched by the stand-in, no example in capture_sweep.py"]
    model_lines = [line for line in problems if line.startswith("model ")]
    assert len(model_lines) == 4, problems             # 2 models x (plain torch.compile, npugraph_ex)
    assert all("equality comparison" in line for line in model_lines), model_lines


@pytest.mark.slow
def test_plain_layer_models_compile_with_inductor_under_the_standin(tmp_path):
    """torch.compile's default backend (inductor) and npugraph_ex as the stand-in runs it by default (inductor
    where the host has a C++ compiler), each compiled once and run as inductor compiled it. Default case for
    the capture itself:
    test_every_patched_callable_and_a_plain_layer_model_capture_under_the_standin."""
    standin, usage = run_sweep(tmp_path, standin=True, backend="inductor", env={"CAPTURE_SWEEP_MODELS_ONLY": "1"})
    assert capture_problems(standin, {}) == []
    for model in ("PlainLayers", "MixedDtypeLayers"):
        entry = usage["compiles"][f"{model} [npugraph_ex]"]
        assert (entry["compiles"], entry["recompiles"]) == (1, 0), entry
        # inductor's TensorifyScalarRestartAnalysis (a Python float input specialised) is dynamo's to act on,
        # not a failure of the host: swallowed, the graph ran eagerly and recompiled at every new value
        assert "eager_fallback" not in entry, entry
