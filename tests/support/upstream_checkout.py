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
