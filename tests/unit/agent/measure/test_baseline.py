"""scripts/collect_baseline.py (agent.measure.baseline, agent.measure.run_log) on realistic logs (tests/data/logs);
the output check it records: tests/unit/engine/test_output_check.py."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from agent.measure import baseline, run_log
from locations import REPO_ROOT, DATA

ROOT = REPO_ROOT
SCRIPT = ROOT / "scripts" / "collect_baseline.py"
LOGS = DATA / "logs"

# The CLI, run in-process (so fixtures can stub engine.environment); the library is agent.measure.baseline.
_spec = importlib.util.spec_from_file_location("collect_baseline_cli", SCRIPT)
cb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cb)

TOP_KEYS = ["timestamp", "yaml_path", "environment", "model_config", "performance", "verification"]
ENV_KEYS = ["npu_model", "num_cards", "cann_version", "pytorch_version", "torch_npu_version",
            "exe_mode", "device"]


def mean(values):
    return sum(values) / len(values)


@pytest.fixture
def recipe(tmp_path):
    """A recipe dir with config/<model>.yaml; returns a factory writing the YAML."""
    def make(model_name="qwen2_5_7b", exe_mode="eager", world_size=1, **extra):
        cfg_dir = tmp_path / "recipe" / "config"
        cfg_dir.mkdir(parents=True, exist_ok=True)
        lines = [f"model_name: {model_name}", f"model_path: /models/{model_name}",
                 f"exe_mode: {exe_mode}", f"world_size: {world_size}",
                 "model_config:", "  dtype: bfloat16",
                 "data_config:", "  batch_size: 2", "  max_new_tokens: 32",
                 "parallel_config:", f"  tp_size: {world_size}"]
        lines += [f"{k}: {v}" for k, v in extra.items()]
        path = cfg_dir / f"{model_name}.yaml"
        path.write_text("\n".join(lines) + "\n")
        return path
    return make


@pytest.fixture
def fake_environment(monkeypatch):
    """engine.environment replaced by a stub (the real one probes the machine)."""
    calls = []

    def detect_environment(device="auto"):
        calls.append(device)
        return {"device": "npu", "npu_model": "Ascend910B4", "num_cards": 8,
                "cann_version": "8.2.RC1", "pytorch_version": "2.5.1",
                "torch_npu_version": "2.5.1.post1", "exe_mode": None, "world_size": 1}

    mod = types.ModuleType("engine.environment")
    mod.detect_environment = detect_environment
    monkeypatch.setitem(sys.modules, "engine.environment", mod)
    return calls


def collect(tmp_path, log, yaml_path, *extra, name="baseline_metadata.json"):
    out = tmp_path / "out" / name
    rc = cb.main(["--log-file", str(log), "--output", str(out), "--yaml-file", str(yaml_path),
                  *extra])
    assert rc == 0
    return out, json.loads(out.read_text())


def run_script(*args, cwd=None):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


# --------------------------------------------------------------------------- our engine logs


def test_engine_log_with_warmup_markers(tmp_path, recipe):
    yaml_path = recipe()
    out, data = collect(tmp_path, LOGS / "engine_warmup.log", yaml_path)

    assert list(data) == TOP_KEYS
    assert list(data["environment"]) == ENV_KEYS
    assert list(data["performance"]) == ["prefill_ms", "decode_avg_ms", "output_text",
                                         "achieved_bandwidth_gbps", "bandwidth_fraction"]
    # An NPU log without the engine's bandwidth line: both null, never invented.
    assert data["performance"]["achieved_bandwidth_gbps"] is None
    assert data["performance"]["bandwidth_fraction"] is None
    assert list(data["verification"])[:3] == ["all_ranks_success", "output_check", "parity"]
    ts = dt.datetime.fromisoformat(data["timestamp"])
    assert ts.tzinfo is not None and ts.microsecond == 0
    assert data["yaml_path"] == "config/qwen2_5_7b.yaml"

    # Environment comes from the log's environment line; num_cards is the world size.
    assert data["environment"] == {
        "npu_model": "Ascend910B4", "num_cards": 1, "cann_version": "8.2.RC1",
        "pytorch_version": "2.5.1", "torch_npu_version": "2.5.1.post1", "exe_mode": "eager",
        "device": "npu"}
    # the YAML's model_path is a folder of this machine: the written baseline names none (a placeholder)
    assert data["model_config"] == {"model_name": "qwen2_5_7b", "model_source": "your_model_source"}

    perf = data["performance"]
    assert perf["prefill_ms"] == 70.15                      # not the warm-up's 1523.40
    assert perf["decode_avg_ms"] == round(mean([71.00, 72.00, 71.50]), 2) == 71.5
    assert perf["output_text"] == ("The capital of France is Paris. It is known for the "
                                   "Eiffel Tower, the Louvre museum and its cafes.")

    ver = data["verification"]
    assert ver["all_ranks_success"] is True
    assert ver["output_check"]["ok"] is True
    assert ver["parity"] is None
    assert ver["collection_warnings"] == []
    assert out.read_text().startswith('{\n  "timestamp"')


def test_model_source_precedence(tmp_path, recipe):
    yaml_path = recipe(model_source="Qwen/Qwen2.5-7B-Instruct")
    _, data = collect(tmp_path, LOGS / "engine_warmup.log", yaml_path)
    assert data["model_config"]["model_source"] == "Qwen/Qwen2.5-7B-Instruct"
    _, data = collect(tmp_path, LOGS / "engine_warmup.log", yaml_path,
                      "--model-source", "hf://Qwen/Qwen2.5-7B-Instruct@main")
    assert data["model_config"]["model_source"] == "hf://Qwen/Qwen2.5-7B-Instruct@main"


def test_yaml_outside_config_dir_is_recorded_as_given(tmp_path):
    yaml_path = tmp_path / "model.yaml"
    yaml_path.write_text("model_name: qwen2_5_7b\nmodel_path: /m\nexe_mode: eager\n")
    _, data = collect(tmp_path, LOGS / "engine_warmup.log", yaml_path)
    assert data["yaml_path"] == str(yaml_path)


def test_multi_run_log_uses_last_run(tmp_path, recipe):
    _, data = collect(tmp_path, LOGS / "multi_run.log", recipe("llama3_8b"))
    perf = data["performance"]
    assert perf["prefill_ms"] == 60.25                          # run 1 had 90.00
    assert perf["decode_avg_ms"] == round(mean([61, 62, 63]), 2) == 62.0
    assert perf["output_text"] == "Once upon a time a fisherman found a bottle with a map inside."
    assert data["environment"]["cann_version"] == "8.2.RC1"     # run 2's environment
    assert data["environment"]["pytorch_version"] == "2.6.0"
    assert data["verification"]["all_ranks_success"] is True


def test_interrupted_last_run_falls_back_with_warning(tmp_path, recipe):
    _, data = collect(tmp_path, LOGS / "interrupted.log", recipe("llama3_8b"))
    perf = data["performance"]
    # The second run's formal call (prefill 55.00) never printed outputs: run 1 is used.
    assert perf["prefill_ms"] == 90.0
    assert perf["decode_avg_ms"] == round(mean([88, 89]), 2) == 88.5
    assert perf["output_text"] == "Once upon a time there was a small village near the sea."
    assert data["environment"]["cann_version"] == "8.1.RC1"     # the run actually measured
    ver = data["verification"]
    assert ver["all_ranks_success"] is False
    assert any("earlier run" in w for w in ver["collection_warnings"])


def test_multiline_output_text(tmp_path, recipe):
    _, data = collect(tmp_path, LOGS / "multiline.log", recipe("qwen2_5_coder"))
    perf = data["performance"]
    assert perf["output_text"] == (
        'def add(a, b):\n    """Return the sum of a and b."""\n    return a + b\n\n'
        "print(add(2, 3))")
    assert perf["prefill_ms"] == 210.4
    assert perf["decode_avg_ms"] == round(mean([100, 102]), 2) == 101.0
    assert data["environment"]["device"] == "cpu"
    assert data["environment"]["num_cards"] == 0


def test_parse_keeps_other_requests_multiline():
    parsed = baseline.parse_log_file(LOGS / "multiline.log")
    formal = run_log.select_formal(parsed).segment
    assert formal.outputs[1] == "Sure, here is the answer:\n42"


# --------------------------------------------------------------------------- upstream logs


def test_upstream_log_exact_values(tmp_path, recipe, fake_environment):
    _, data = collect(tmp_path, LOGS / "upstream.log", recipe("deepseek_v3", world_size=1))
    perf = data["performance"]
    expected_prefill = 123.45          # second generate call; the first (2010.55) is warm-up
    expected_decode = (20.0 + 30.0 + 40.0) / 3   # decodes [10, 20, 30, 40] without the first
    assert perf["prefill_ms"] == expected_prefill
    assert perf["decode_avg_ms"] == expected_decode == 30.0
    assert perf["output_text"] == ("Large language models predict the next token from the "
                                   "previous ones, one step at a time.")
    # No environment line: detected on this machine, with a warning saying so.
    assert fake_environment == ["auto"]
    env = data["environment"]
    assert env["device"] == "npu" and env["npu_model"] == "Ascend910B4"
    assert env["num_cards"] == 1 and env["exe_mode"] == "eager"
    ver = data["verification"]
    assert ver["all_ranks_success"] is True
    assert any("no environment line" in w for w in ver["collection_warnings"])


def test_upstream_interrupted_last_call(tmp_path, recipe, fake_environment):
    _, data = collect(tmp_path, LOGS / "upstream_interrupted.log", recipe("deepseek_v3"))
    perf = data["performance"]
    assert perf["prefill_ms"] == 123.45                 # not the interrupted 130.00
    assert perf["decode_avg_ms"] == 30.0
    ver = data["verification"]
    assert ver["all_ranks_success"] is False
    assert any("interrupted" in w for w in ver["collection_warnings"])


def test_upstream_single_call_and_single_decode(tmp_path, recipe, fake_environment):
    log = tmp_path / "single.log"
    log.write_text(
        "2025-06-12 10:21:08,125 - INFO - m inference time cost of prefill is 123.456 ms\n"
        "2025-06-12 10:21:08,136 - INFO - m inference time cost of decode is 10.00 ms\n"
        "2025-06-12 10:21:08,301 - INFO - Request 0: outputs: Paris is the capital of France.\n")
    _, data = collect(tmp_path, log, recipe("m"))
    perf = data["performance"]
    assert perf["prefill_ms"] == 123.46
    assert perf["decode_avg_ms"] is None                # the only decode step is excluded
    warnings = data["verification"]["collection_warnings"]
    assert any("no warm-up detected" in w for w in warnings)
    assert any("only one decode step" in w for w in warnings)


def test_environment_fallback_without_engine_environment(tmp_path, recipe, monkeypatch):
    monkeypatch.setitem(sys.modules, "engine.environment", None)   # import fails
    _, data = collect(tmp_path, LOGS / "upstream.log", recipe("deepseek_v3"))
    env = data["environment"]
    from importlib.metadata import version
    assert env["pytorch_version"] == version("torch")
    assert env["device"] is None and env["num_cards"] is None
    assert env["npu_model"] is None and env["cann_version"] is None
    assert env["exe_mode"] == "eager"


# --------------------------------------------------------------------------- ranks


def test_rank_dir_with_failed_rank(tmp_path, recipe):
    yaml_path = recipe("qwen3_32b", world_size=2)
    _, data = collect(tmp_path, LOGS / "ranks", yaml_path)
    assert data["performance"]["prefill_ms"] == 101.1
    assert data["performance"]["decode_avg_ms"] == round(mean([100, 102]), 2) == 101.0
    assert data["environment"]["num_cards"] == 2
    ver = data["verification"]
    assert ver["all_ranks_success"] is False
    assert any("rank 1" in w and "HCCL" in w for w in ver["collection_warnings"])

    _, data = collect(tmp_path, LOGS / "ranks", yaml_path, "--rank", "1")
    assert data["performance"]["prefill_ms"] == 99.9
    assert data["performance"]["decode_avg_ms"] == round(mean([98, 99]), 2) == 98.5
    assert data["verification"]["all_ranks_success"] is False


def test_rank_dir_all_ranks_ok(tmp_path, recipe):
    res = tmp_path / "res"
    res.mkdir()
    shutil.copy(LOGS / "ranks" / "log_0.log", res / "log_0.log")
    shutil.copy(LOGS / "ranks" / "log_0.log", res / "log_1.log")
    _, data = collect(tmp_path, res, recipe("qwen3_32b", world_size=2))
    assert data["verification"]["all_ranks_success"] is True


def test_rank_dir_missing_rank_log(tmp_path, recipe, capsys):
    rc = cb.main(["--log-file", str(LOGS / "ranks"), "--output", str(tmp_path / "o.json"),
                  "--yaml-file", str(recipe()), "--rank", "5"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "log_5.log" in err


# --------------------------------------------------------------------------- the log line table

LINE_SAMPLES = [
    ("[INFO][2026-09-29 14:03:10.121][scheduler.py:412] [Main] Inference time (prefill): 53.90 ms",
     "time", "executor"),
    ("[2026-11-29 17:40:01,123] [INFO] qwen inference time cost of decode is 71.00 ms", "time", "engine"),
    ("[2026-11-29 17:40:01,123] [INFO] Request 0: outputs: Paris", "output", "engine"),
    ("Inference decode result for batch 0: ", "output", "upstream"),
    ("qwen decode average inference time cost is 70.00 ms", "average", "executor"),
    ("qwen average inference time cost is 70.00 ms", "average", "engine"),
    ("[2026-11-29 17:40:01,123] [INFO] qwen decode 285.1 steps/s x batch 2, achieved bandwidth 0.11 GB/s",
     "bandwidth", "engine"),
    ("[2026-11-29 17:40:01,123] [INFO] qwen warm-up run begins", "warmup", "engine"),
    ('[2026-11-29 17:40:01,123] [INFO] qwen environment: {"device": "npu"}', "environment", "engine"),
    ("[INFO][2026-12-05 12:00:01.002][infer.py:104] Finished inference, the number of valid output tokens is 24, "
     "total number of draft tokens is 14, total accepted number is 9", "speculation", "executor"),
    ("[INFO][2026-12-05 12:00:01.004][infer.py:113] The speculation accept rate: 0.6429", "speculation", "executor"),
    ("Traceback (most recent call last):", "traceback", "any"),
]


@pytest.mark.parametrize("line, kind, style", LINE_SAMPLES)
def test_each_log_line_is_read_by_its_row_of_the_format_table(line, kind, style):
    fmt, m = run_log.match_line(line)
    assert (fmt.kind, fmt.style) == (kind, style)    # first match wins: framework before engine
    assert run_log.is_record_start(line)


def test_every_row_of_the_format_table_has_a_sample():
    assert sorted((f.kind, f.style) for f in run_log.LINE_FORMATS) == sorted((k, s) for _, k, s in LINE_SAMPLES)
    assert run_log.match_line("  continuation of a multi-line output") == (None, None)


MTP_TAIL = ("[INFO][2026-12-05 12:00:01.002][infer.py:104] Finished inference, the number of valid output tokens is "
            "24, total number of draft tokens is 14, total accepted number is 9\n"
            "[INFO][2026-12-05 12:00:01.003][infer.py:107] gemma-4 main and mtp model average inference time cost is "
            "13.00 ms\n"
            "[INFO][2026-12-05 12:00:01.003][infer.py:112] The speculation accept length: 1.6429\n"
            "[INFO][2026-12-05 12:00:01.004][infer.py:113] The speculation accept rate: 0.6429\n")


@pytest.mark.parametrize("tail", ["mtp", "none"])
def test_the_mtp_acceptance_upstream_logs_is_in_the_baseline(tmp_path, fake_environment, tail):
    """next_n > 0: upstream's log_results figures (drafts, accepted, rate, length) under performance.speculation;
    a run without them (MTP off) has none."""
    logs = tmp_path / "res"
    logs.mkdir()
    text = (LOGS / "framework" / "log_0.log").read_text()
    (logs / "log_0.log").write_text(text + (MTP_TAIL if tail == "mtp" else ""))
    yaml_path = tmp_path / "m.yaml"
    yaml_path.write_text(FRAMEWORK_SCHEMA.format(exe_mode="eager").replace("model_config:\n", "model_config:\n  next_n: 1\n", 1))
    _, data = collect(tmp_path, logs / "log_0.log", yaml_path)
    if tail == "none":
        assert "speculation" not in data["performance"]
        return
    assert data["performance"]["speculation"] == {"valid_output_tokens": 24, "draft_tokens": 14, "accepted_tokens": 9,
                                                  "accept_length": 1.6429, "accept_rate": 9 / 14, "next_n": 1}


# --------------------------------------------------------------------------- output file


def test_previous_baseline_is_kept(tmp_path, recipe, capsys):
    yaml_path = recipe("llama3_8b")
    out, first = collect(tmp_path, LOGS / "multi_run.log", yaml_path)
    first_text = out.read_text()
    capsys.readouterr()
    out, second = collect(tmp_path, LOGS / "interrupted.log", yaml_path)
    kept = sorted(out.parent.glob("baseline_metadata.previous*.json"))
    assert [p.name for p in kept] == ["baseline_metadata.previous.json"]
    assert kept[0].read_text() == first_text
    assert str(kept[0]) in capsys.readouterr().out
    assert second["performance"]["prefill_ms"] == 90.0
    # A third run keeps the second one in its place: one previous baseline, never a growing pile.
    second_text = out.read_text()
    collect(tmp_path, LOGS / "multi_run.log", yaml_path)
    assert sorted(p.name for p in out.parent.glob("baseline_metadata.previous*.json")) == ["baseline_metadata.previous.json"]
    assert kept[0].read_text() == second_text


@pytest.mark.parametrize("parity, output_check", [
    ({"ok": True, "checked": True, "max_abs_logits_diff": 0.0}, "kept"),
    ({"ok": True, "checked": True, "untrained_weights": True},
     "untrained weights: text checks skipped, parity used"),
    ({"ok": None, "checked": False, "untrained_weights": True}, "untrained weights: text checks skipped"),
])
def test_verify_writes_the_collected_baseline_once_with_parity(tmp_path, recipe, parity, output_check):
    """What node_verify writes: the collected baseline with parity in place, same key order, and
    for untrained weights the text check marked skipped; one write through write_baseline."""
    collected, _ = baseline.collect(str(LOGS / "engine_warmup.log"), str(recipe()))
    verified = baseline.with_verification(collected, parity)
    assert collected["verification"]["parity"] is None          # the collected dict is not changed
    assert list(verified) == TOP_KEYS
    ver = verified["verification"]
    assert list(ver) == ["all_ranks_success", "output_check", "parity", "collection_warnings"]
    assert ver["parity"] == parity
    if output_check == "kept":
        assert ver["output_check"] == collected["verification"]["output_check"]
    else:
        assert ver["output_check"] == dict(collected["verification"]["output_check"], ok=None,
                                           skipped=output_check)
    out = tmp_path / "baseline" / "baseline_metadata.json"
    assert baseline.write_baseline(out, verified) is None
    written = dict(verified, model_config=dict(verified["model_config"], model_source="your_model_source"))
    assert verified["model_config"]["model_source"] == "/models/qwen2_5_7b"      # the collected record, unchanged
    assert out.read_text() == json.dumps(written, indent=2, ensure_ascii=False) + "\n"
    assert list(out.parent.iterdir()) == [out]                   # no temporary or previous file left


# --------------------------------------------------------------------------- CLI errors


def _one_line_error(proc, code):
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("collect_baseline: error: ") and " — " in lines[0]
    return lines[0]


def test_failed_run_exits_3(tmp_path, recipe):
    out = tmp_path / "baseline_metadata.json"
    proc = run_script("--log-file", LOGS / "failed.log", "--output", out,
                      "--yaml-file", recipe())
    line = _one_line_error(proc, 3)
    assert "no formal prefill" in line and "NPU out of memory" in line
    assert not out.exists()


def test_missing_log_exits_2(tmp_path, recipe):
    out = tmp_path / "baseline_metadata.json"
    proc = run_script("--log-file", tmp_path / "res" / "log_0.log", "--output", out,
                      "--yaml-file", recipe())
    line = _one_line_error(proc, 2)
    assert "not found" in line and "infer.sh" in line
    assert not out.exists()


def test_missing_yaml_exits_2(tmp_path):
    proc = run_script("--log-file", LOGS / "engine_warmup.log", "--output",
                      tmp_path / "o.json", "--yaml-file", tmp_path / "config" / "nope.yaml")
    line = _one_line_error(proc, 2)
    assert "nope.yaml" in line


def test_unreadable_yaml_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_name: [unclosed\nexe_mode: eager\n")
    rc = cb.main(["--log-file", str(LOGS / "engine_warmup.log"), "--output",
                  str(tmp_path / "o.json"), "--yaml-file", str(bad)])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot parse YAML" in err


def test_script_runs_from_any_cwd(tmp_path, recipe):
    out = tmp_path / "res" / "baseline_metadata.json"
    proc = run_script("--log-file", LOGS / "engine_warmup.log", "--output", out,
                      "--yaml-file", recipe(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "prefill 70.15 ms" in proc.stdout and "decode avg 71.50 ms" in proc.stdout
    data = json.loads(out.read_text())
    assert data["verification"]["output_check"]["ok"] is True   # engine imported from repo


# --------------------------------------------------------------------------- cann-recipes-infer styles

LEGACY_SCHEMA = """model_name: "gpt_oss"
model_path: "/data/models/gpt-oss-20b-bf16"
exe_mode: "{exe_mode}"        # ["eager"]
world_size: 1

model_config:
  enable_profiler: False
  enable_online_split_weight: True

data_config:
  dataset: "default"
  input_max_len: 32
  max_new_tokens: 100
  batch_size: 1
"""

FRAMEWORK_SCHEMA = """model_name: "gemma-4"
world_size: 8  # keep it for backward compatibility.

model_config:
  model_name: "gemma-4"
  model_path: "/data/models/gemma-4-26B-A4B"
  exe_mode: "{exe_mode}"          # ["eager", "ge_graph", "npugraph_ex"]
  with_ckpt: True

data_config:
  dataset: "default"
  input_truncated_len: 256

parallel_config:
  world_size: 2
  attn_tp_size: 1

scheduler_config:
  max_new_tokens: 6
  batch_size: 2
"""


@pytest.mark.parametrize("log, schema, exe_mode, rank, expected", [
    # legacy ModelRunner: "[LLM](file:line): {name} inference time cost of ...", warm-up logged too
    ("legacy_llm.log", LEGACY_SCHEMA, "eager", 0,
     dict(prefill=88.40, decode=mean([22, 24, 26]), name="gpt_oss", source="/data/models/gpt-oss-20b-bf16",
          cards=1, text="The quick answer is yes.\nAscend NPUs run large models with CANN.")),
    # framework: "[Main] Inference time (prefill|decode): X ms"; first prefill batch; MTP lines ignored
    ("framework", FRAMEWORK_SCHEMA, "ge_graph", 0,
     dict(prefill=52.31, decode=mean([11, 12, 13, 14]), name="gemma-4", source="/data/models/gemma-4-26B-A4B",
          cards=2, text="Paris is the capital of France.\nIt sits on the Seine.")),
    ("framework", FRAMEWORK_SCHEMA, "npugraph_ex", 1,
     dict(prefill=53.90, decode=mean([15, 17]), name="gemma-4", source="/data/models/gemma-4-26B-A4B",
          cards=2, text="Rome is the capital of Italy.")),
    # an exe_mode this tool has never heard of is recorded as written
    ("framework/log_0.log", FRAMEWORK_SCHEMA, "my_future_mode", 0,
     dict(prefill=52.31, decode=12.5, name="gemma-4", source="/data/models/gemma-4-26B-A4B", cards=2,
          text="Paris is the capital of France.\nIt sits on the Seine.")),
    # the same log styles with the other YAML schema: the schema does not change the figures
    ("legacy_llm.log", FRAMEWORK_SCHEMA, "eager", 0,
     dict(prefill=88.40, decode=24.0, name="gemma-4", source="/data/models/gemma-4-26B-A4B", cards=2,
          text="The quick answer is yes.\nAscend NPUs run large models with CANN.")),
])
def test_cann_recipes_log_styles_and_yaml_schemas(tmp_path, fake_environment, log, schema, exe_mode, rank, expected):
    yaml_path = tmp_path / "recipe" / "config" / "model.yaml"
    yaml_path.parent.mkdir(parents=True)
    yaml_path.write_text(schema.format(exe_mode=exe_mode))
    _, data = collect(tmp_path, LOGS / log, yaml_path, "--rank", str(rank))
    perf = data["performance"]
    assert perf["prefill_ms"] == expected["prefill"]
    assert perf["decode_avg_ms"] == round(expected["decode"], 2)
    assert perf["output_text"] == expected["text"]
    # model_path is a folder of this machine (expected["source"]): the written baseline holds the placeholder
    assert expected["source"].startswith("/")
    assert data["model_config"] == {"model_name": expected["name"], "model_source": "your_model_source"}
    assert data["environment"]["exe_mode"] == exe_mode
    assert data["environment"]["num_cards"] == expected["cards"]
    ver = data["verification"]
    assert ver["all_ranks_success"] is True
    # the framework warms up inside its engine and logs no timing for it: no "no warm-up" warning
    assert not any("no warm-up" in w for w in ver["collection_warnings"])


def test_framework_rank_that_did_not_finish_fails_all_ranks(tmp_path, fake_environment):
    logs = tmp_path / "res"
    logs.mkdir()
    shutil.copy(LOGS / "framework" / "log_0.log", logs / "log_0.log")
    (logs / "log_1.log").write_text(
        "[INFO][2026-09-29 14:03:10.121][scheduler.py:412] [Main] Inference time (prefill): 53.90 ms\n"
        "Traceback (most recent call last):\n  File \"/repo/executor/core/engine/execution_engine.py\", line 9\n"
        "RuntimeError: HCCL timeout\n")
    yaml_path = tmp_path / "m.yaml"
    yaml_path.write_text(FRAMEWORK_SCHEMA.format(exe_mode="eager"))
    _, data = collect(tmp_path, logs, yaml_path)
    assert data["performance"]["prefill_ms"] == 52.31
    ver = data["verification"]
    assert ver["all_ranks_success"] is False
    assert any("rank 1" in w and "HCCL timeout" in w for w in ver["collection_warnings"])


def test_yaml_settings_from_either_schema():
    import yaml as pyyaml

    legacy = baseline.yaml_settings(pyyaml.safe_load(LEGACY_SCHEMA.format(exe_mode="eager")))
    framework = baseline.yaml_settings(pyyaml.safe_load(FRAMEWORK_SCHEMA.format(exe_mode="npugraph_ex")))
    assert legacy == {"model_name": "gpt_oss", "model_path": "/data/models/gpt-oss-20b-bf16", "model_source": None,
                      "exe_mode": "eager", "world_size": 1, "max_new_tokens": 100, "batch_size": 1,
                      "input_len": 32}
    assert framework == {"model_name": "gemma-4", "model_path": "/data/models/gemma-4-26B-A4B",
                         "model_source": None, "exe_mode": "npugraph_ex", "world_size": 2,
                         "max_new_tokens": 6, "batch_size": 2, "input_len": 256}


# --------------------------------------------------------------------------- achieved bandwidth


def _bandwidth_log(path: Path, env: dict) -> Path:
    header = "[2026-11-30 07:00:00,000] [INFO] "
    lines = [f"tiny environment: {json.dumps(env)}", "tiny warm-up run begins",
             "tiny inference time cost of prefill is 9.00 ms", "tiny inference time cost of decode is 5.00 ms",
             "Request 0: outputs: warm", "tiny decode 250.0 steps/s x batch 1, achieved bandwidth 999.00 GB/s",
             "tiny warm-up run ends",
             "tiny inference time cost of prefill is 8.00 ms", "tiny inference time cost of decode is 4.00 ms",
             "tiny inference time cost of decode is 1.00 ms", "tiny inference time cost of decode is 1.00 ms",
             "Request 0: outputs: The answer is a short sentence of text.",
             "tiny decode 1000.0 steps/s x batch 1, achieved bandwidth 2400.00 GB/s"]
    path.write_text("".join(header + line + "\n" for line in lines))
    return path


@pytest.mark.parametrize("env, fraction", [
    ({"device": "cuda", "cuda_device_name": "NVIDIA H200", "exe_mode": "graph"}, 0.5),
    ({"device": "cuda", "cuda_device_name": "NVIDIA A100-SXM4-40GB", "exe_mode": "graph"}, round(2400 / 1555, 4)),
    ({"device": "cuda", "cuda_device_name": "Some Future GPU", "exe_mode": "graph"}, None),
    ({"device": "cpu", "cuda_device_name": None, "exe_mode": "eager"}, None),
])
def test_achieved_bandwidth_and_fraction_of_the_published_peak(tmp_path, recipe, env, fraction):
    """The formal call's bandwidth line (not the warm-up's); the fraction only where the peak is listed."""
    log = _bandwidth_log(tmp_path / "log_0.log", env)
    _, data = collect(tmp_path, log, recipe())
    assert data["performance"]["decode_avg_ms"] == 1.0
    assert data["performance"]["achieved_bandwidth_gbps"] == 2400.0
    assert data["performance"]["bandwidth_fraction"] == fraction
