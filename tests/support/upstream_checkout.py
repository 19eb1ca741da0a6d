"""A copy of the upstream cann-recipes-infer snapshot (../shared) to migrate into or run, as a git checkout or a
plain tree, and `migrator run RECIPE --standin --tiny` on one of its models."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from locations import REPO_ROOT
from migrator_cli import run_cli


SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"


def _git(checkout: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=checkout,
                          capture_output=True, text=True, check=True).stdout


def copy_checkout(dest: Path) -> Path:
    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT} (../shared is absent)")
    target = dest / "cann-recipes-infer"
    shutil.copytree(SNAPSHOT, target)
    for path in [target, *target.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o200)
    _git(target, "init", "-q")
    _git(target, "add", "-A")
    _git(target, "commit", "-qm", "snapshot")
    return target


# graph mode's decode step as the captured graph run eagerly: inductor's compile takes minutes on 2 cores
FAST = {"NPU_STANDIN_COMPILE": "capture"}


def copy_snapshot(target: Path) -> Path:
    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT} (../shared is absent)")
    shutil.copytree(SNAPSHOT, target)
    for path in [target, *target.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o200)
    return target


def run_standin(checkout: Path, model: str, *args: str, timeout: int = 1800):
    proc = run_cli("run", str(checkout / "models" / model), "--standin", "--tiny", "--max-rounds", "0", "--json",
                   *args, env=FAST, timeout=timeout)
    summary = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    return proc, summary


# upstream's models/gpt_oss passes pre_tokens=sliding_window to the fused attention's band (sparse_mode 4), which
# keeps the query's key and `window` before it: one key more than transformers' window (key j > i - window).
# `migrator run models/gpt_oss --standin --tiny` (a window of 16, shorter than the run's sequences) fails on it
# (tests/e2e/test_upstream_recipes_standin.py); tests about something else run the corrected copy.
GPT_OSS_WINDOW = "pre_tokens=self.sliding_window if self.sliding_window else"


def correct_gpt_oss_window(checkout: Path) -> None:
    """The checkout's models/gpt_oss with pre_tokens = window - 1 (transformers' window) at prefill and decode."""
    modeling = checkout / "models" / "gpt_oss" / "models" / "modeling_gpt_oss.py"
    text = modeling.read_text()
    assert text.count(GPT_OSS_WINDOW) == 2, "upstream's gpt_oss window call changed"
    modeling.write_text(text.replace(GPT_OSS_WINDOW, "pre_tokens=self.sliding_window - 1 if self.sliding_window else"))
