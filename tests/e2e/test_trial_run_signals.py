"""Signals as they come: a timeout, SIGTERM or Ctrl-C stops the whole process tree of a trial run
(bash, torchrun, every rank, what infer.sh started with `&`) and of the parity subprocess; the run
record has the peak RSS over all the tree's processes. Real `migrator run` subprocesses, real
signals; every process a test starts carries a tag in its environment, so the test can prove none
survived."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from locations import REPO_ROOT
from process_tags import _tagged


def _start(args: list[str], tag: str, cwd: Path = REPO_ROOT) -> subprocess.Popen:
    env = dict(os.environ, FIELD_TAG=tag, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "agent.cli", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(proc: subprocess.Popen, marker: str, seen: list[str], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    for line in proc.stderr:
        seen.append(line)
        if line.startswith(marker):
            return
        assert time.monotonic() < deadline, "".join(seen)[-2000:]
    raise AssertionError("".join(seen)[-2000:])


def _background_child(recipe: Path, mark: Path, after_s: float = 6.0) -> None:
    """infer.sh starts a helper with `&` (as upstream's launch starts its ranks): it writes `mark`
    after `after_s` seconds unless it was stopped."""
    infer_sh = recipe / "infer.sh"
    text = infer_sh.read_text()
    line = (f'python3 -c "import time; time.sleep({after_s}); open(\'{mark}\', \'w\').write(\'still alive\')" &\n')
    at = text.index("exec ")
    infer_sh.write_text(text[:at] + line + text[at:])


def _hang_in_generate(recipe: Path) -> None:
    runner = next(recipe.glob("runner_*.py"))
    text = runner.read_text().rstrip("\n") + "\n"
    text = text.replace("from engine.model_runner import ModelRunner\n", "from engine.model_runner import ModelRunner\nimport time\n", 1)
    runner.write_text(text + "\n    def model_generate(self, prompts, warm_up=False):\n        time.sleep(600)\n")


def test_a_timeout_stops_the_whole_tree(working_recipe, tmp_path):
    tag, mark = uuid.uuid4().hex, tmp_path / "mark"
    _background_child(working_recipe, mark, after_s=20)
    _hang_in_generate(working_recipe)
    proc = _start(["run", str(working_recipe), "--timeout", "15", "--max-rounds", "0", "--json"], tag)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-2000:]
    report = json.loads((working_recipe / "migration_report.json").read_text())
    run = report["runs"][0]
    assert run["timed_out"] and run["processes"] >= 2, run
    time.sleep(1)
    assert _tagged(tag) == [], "processes of the timed-out tree survived"
    time.sleep(21 - 15)
    assert not mark.exists()


@pytest.mark.parametrize("sig, code, says", [
    pytest.param(signal.SIGTERM, 143, "terminated (SIGTERM)", marks=pytest.mark.slow),   # the same path as SIGINT
    (signal.SIGINT, 130, "interrupted")])
def test_a_signal_during_the_trial_run_stops_its_tree_and_resume_continues(working_recipe, tmp_path, sig, code, says):
    """The background helper would write its file 6 s later: it must not (the reports saw one write
    12 s after the migrator died)."""
    tag, mark = uuid.uuid4().hex, tmp_path / "mark"
    _background_child(working_recipe, mark)
    proc = _start(["run", str(working_recipe)], tag)
    seen: list[str] = []
    _wait_for(proc, "[migrator] classify ...", seen)
    time.sleep(2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    err = "".join(seen) + err
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("migrator:")]
    assert len(lines) == 1 and says in lines[0] and "--resume" in lines[0], err[-2000:]
    assert _tagged(tag) == []
    time.sleep(7)
    assert not mark.exists(), "a process of the stopped run kept running"


def test_two_ctrl_c_give_one_line_and_no_atexit_traceback(working_recipe):
    tag = uuid.uuid4().hex
    proc = _start(["run", str(working_recipe)], tag)
    seen: list[str] = []
    _wait_for(proc, "[migrator] classify ...", seen)
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
    assert [ln for ln in err.splitlines() if ln.startswith("migrator:")] == [
        "migrator: interrupted; continue with --resume"]
    assert _tagged(tag) == []


@pytest.mark.slow  # the timeout and SIGINT tests here stop the same process tree by default
def test_sigterm_during_verify_stops_the_parity_subprocess(working_recipe):
    tag = uuid.uuid4().hex
    proc = _start(["run", str(working_recipe)], tag)
    seen: list[str] = []
    _wait_for(proc, "[migrator] verify ...", seen)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
            b"agent.measure.parity" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in _tagged(tag)
            if Path(f"/proc/{pid}/cmdline").exists()):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert _tagged(tag) == []


def test_peak_rss_is_summed_over_the_tree(working_recipe):
    """A helper started by infer.sh holds 300 MB while the model runs: the run's peak counts it."""
    infer_sh = working_recipe / "infer.sh"
    text = infer_sh.read_text()
    helper = 'python3 -c "import time; b = bytearray(300 * 2**20); time.sleep(8)" &\n'
    at = text.index("exec ")
    infer_sh.write_text(text[:at] + helper + text[at:])
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "run", str(working_recipe), "--json"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((working_recipe / "migration_report.json").read_text())
    run = report["runs"][0]
    assert run["processes"] >= 2 and run["peak_rss_bytes"] > 300 * 2**20 + 100 * 2**20, run
    summary = (working_recipe / "migration_summary.md").read_text()
    assert re.search(r"peak RSS \d+ MiB over \d+ process", summary), summary


@pytest.mark.slow  # the timeout and SIGINT tests here stop the same process tree by default
def test_a_tree_left_by_a_sigkilled_migrator_is_stopped_by_the_next_run(working_recipe, tmp_path):
    tag, mark = uuid.uuid4().hex, tmp_path / "mark"
    _background_child(working_recipe, mark, after_s=40)
    proc = _start(["run", str(working_recipe)], tag)
    seen: list[str] = []
    _wait_for(proc, "[migrator] classify ...", seen)
    time.sleep(2)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    time.sleep(0.5)
    assert _tagged(tag), "the SIGKILLed migrator's tree should still be running here"
    again = subprocess.run([sys.executable, "-m", "agent.cli", "run", str(working_recipe), "--resume", "--json"],
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert _tagged(tag) == []
    assert not mark.exists()


def test_two_identical_migrations_at_once_the_second_is_refused(tiny_checkpoints, tmp_path):
    ckpt = tiny_checkpoints("llama")
    out = tmp_path / "out"
    args = ["run", str(ckpt), "--name", "m", "--output-dir", str(out), "--device", "cpu", "--max-new-tokens", "4"]
    tag = uuid.uuid4().hex
    first = _start(args, tag)
    seen: list[str] = []
    _wait_for(first, "[migrator] detect_env ...", seen)
    second = subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 75, second.stderr[-2000:]
    lines = [ln for ln in second.stderr.splitlines() if ln.startswith("migrator:")]
    assert len(lines) == 1 and "another migrator run" in lines[0] and "in progress" in lines[0], second.stderr
    rest_out, rest_err = first.communicate(timeout=600)
    assert first.returncode == 0, ("".join(seen) + rest_err)[-2000:]


def test_killed_after_render_then_the_same_command_keeps_the_saved_run_and_resume_works(tiny_checkpoints, tmp_path):
    ckpt = tiny_checkpoints("llama")
    out = tmp_path / "out"
    args = ["run", str(ckpt), "--name", "m", "--output-dir", str(out), "--device", "cpu", "--max-new-tokens", "4"]
    proc = _start(args, uuid.uuid4().hex)
    seen: list[str] = []
    _wait_for(proc, "[migrator] trial_run ...", seen)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    threads = (out / ".migrator" / "threads.json").read_bytes()
    again = subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 2 and "--resume" in again.stderr and "Traceback" not in again.stderr, again.stderr
    assert (out / ".migrator" / "threads.json").read_bytes() == threads            # the saved run is kept
    resumed = subprocess.run([sys.executable, "-m", "agent.cli", *args, "--resume"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0 and "resuming at trial_run" in resumed.stderr, resumed.stderr[-2000:]
