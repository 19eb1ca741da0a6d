"""The workflow through the CLI: classify A / B / C and scenarios B and C on a real recipe, `migrator env`,
`--device npu` on a host without one, resume after a kill. The graph itself, in-process:
tests/unit/agent/workflow/."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from locations import REPO_ROOT
from migrator_cli import run_cli


# ---- CLI: env ----------------------------------------------------------------------------
def test_env_json_reports_the_cpu_actually_used():
    proc = run_cli("env", "--json")
    assert proc.returncode == 0, proc.stderr
    env = json.loads(proc.stdout)
    assert env["device"] == "cpu" and env["pytorch_version"].startswith("2.")
    assert env["npu_model"] is None and env["num_cards"] == 0


def test_env_device_npu_without_npu_is_a_one_line_environment_error():
    proc = run_cli("env", "--device", "npu")
    assert proc.returncode == 4
    assert len(proc.stderr.strip().splitlines()) == 1 and "npu" in proc.stderr and "Traceback" not in proc.stderr


def test_run_device_npu_without_npu_stops_before_any_work(tiny_checkpoints, tmp_path):
    proc = run_cli("run", str(tiny_checkpoints("llama")), "--output-dir", str(tmp_path), "--device", "npu")
    assert proc.returncode == 4 and "Traceback" not in proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("migrator: error:")]
    assert not any(p.is_dir() and p.name != ".migrator" for p in tmp_path.iterdir())


# ---- CLI: classify and scenarios B/C on a real recipe ------------------------------------
@pytest.fixture(scope="module")
def recipe(tiny_checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("wf")
    proc = run_cli("run", str(tiny_checkpoints("qwen2")), "--name", "wf", "--output-dir", str(out),
                   "--device", "cpu", "--max-new-tokens", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "wf"


@pytest.mark.slow  # scenarios B and C have their own default cases below; this one runs all three in a row
def test_classify_a_b_c(tiny_checkpoints, recipe, tmp_path):
    proc = run_cli("classify", str(tiny_checkpoints("llama")))
    assert proc.returncode == 0 and proc.stdout.startswith("A:")
    proc = run_cli("classify", str(recipe))
    assert proc.returncode == 0 and proc.stdout.startswith("C:"), proc.stdout + proc.stderr
    broken = tmp_path / "broken"
    shutil.copytree(recipe, broken)
    (broken / "infer.py").write_text((broken / "infer.py").read_text().replace("def main():", "def main(:"))
    proc = run_cli("classify", str(broken))
    assert proc.returncode == 0 and proc.stdout.startswith("B:") and "SyntaxError" in proc.stdout
    proc = run_cli("classify", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_scenario_c_recollects_baseline_and_keeps_the_previous_one(recipe, tmp_path):
    copy = tmp_path / "c"
    shutil.copytree(recipe, copy)
    before = json.loads((copy / "baseline" / "baseline_metadata.json").read_text())
    proc = run_cli("run", str(copy), "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    assert summary["scenario"] == "C" and summary["status"] == "ok"
    kept = list((copy / "baseline").glob("baseline_metadata.previous*.json"))
    assert [p.name for p in kept] == ["baseline_metadata.previous.json"] and json.loads(kept[0].read_text()) == before
    after = json.loads((copy / "baseline" / "baseline_metadata.json").read_text())
    assert after["performance"]["prefill_ms"] is not None and after["verification"]["parity"]["ok"]


def test_scenario_b_unknown_failure_is_reported_with_file_and_line(recipe, tmp_path):
    broken = tmp_path / "b"
    shutil.copytree(recipe, broken)
    runner = broken / "runner_wf.py"
    runner.write_text(runner.read_text() + "\n    def model_input_prepare(self, batch):\n"
                                           "        raise KeyError('mystery')\n")
    proc = run_cli("run", str(broken), "--json")
    assert proc.returncode == 1
    summary = json.loads(proc.stdout)
    assert summary["scenario"] == "B" and summary["status"] == "failed"
    assert "KeyError" in summary["message"] and "runner_wf.py:" in summary["message"]
    report = json.loads((broken / "migration_report.json").read_text())
    assert report["rounds"][0]["diagnosis"]["location"].endswith(tuple(f"runner_wf.py:{n}" for n in range(1, 200)))


@pytest.mark.slow  # resume after a kill is covered by default by tests/e2e/test_trial_run_signals.py (killed after render, then --resume)
# ---- resume ------------------------------------------------------------------------------
def test_killed_run_resumes_to_the_same_recipe(tiny_checkpoints, tmp_path):
    ckpt = tiny_checkpoints("llama")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "agent.cli", "run", str(ckpt), "--name", "r", "--output-dir", str(out),
           "--device", "cpu", "--max-new-tokens", "8"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    for line in proc.stderr:           # kill it as soon as the trial run starts
        if "trial_run ..." in line:
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    recipe = out / "r"
    assert (recipe / "infer.sh").is_file() and not (recipe / "baseline").exists()

    resumed = subprocess.run(cmd + ["--resume", "--json"], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming at trial_run" in resumed.stderr
    assert "vendor ..." not in resumed.stderr          # finished nodes are not redone
    assert json.loads(resumed.stdout)["status"] == "ok"
    assert (recipe / "baseline" / "baseline_metadata.json").is_file()

    fresh = run_cli("run", str(ckpt), "--name", "r", "--output-dir", str(tmp_path / "fresh"), "--device", "cpu",
                    "--max-new-tokens", "8")
    assert fresh.returncode == 0
    for rel in ["infer.py", "infer.sh", "runner_r.py", "models/modeling_r.py", "config/r_1card_eager.yaml"]:
        assert (recipe / rel).read_bytes() == (tmp_path / "fresh" / "r" / rel).read_bytes(), rel
