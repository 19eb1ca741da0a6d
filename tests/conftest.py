"""Shared fixtures: tiny local checkpoints (SPEC §5) and a helper to run the CLI for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# Tests run two workers side by side on small models: one BLAS thread per process avoids
# oversubscribing the cores (timings in test baselines are not benchmarks).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Factory: model_type -> directory of a tiny checkpoint, built once per session."""
    from agent.tiny_checkpoint import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    cache: dict[str, Path] = {}

    def get(model_type: str, **overrides) -> Path:
        key = model_type + json.dumps(overrides, sort_keys=True)
        if key not in cache:
            cache[key] = build_tiny_checkpoint(model_type, root / f"tiny_{model_type}_{len(cache)}", **overrides)
        return cache[key]

    return get


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 900, env: dict | None = None):
    """Run `migrator ...` in a subprocess, as a user would."""
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=cwd or REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="session")
def working_recipe_source(tiny_checkpoints, tmp_path_factory):
    """A recipe migrated once per session (tiny llama, 8 new tokens); copy it, don't modify it."""
    out = tmp_path_factory.mktemp("working")
    proc = run_cli("run", str(tiny_checkpoints("llama")), "--name", "fi", "--output-dir", str(out),
                   "--device", "cpu", "--max-new-tokens", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "fi"


@pytest.fixture
def working_recipe(working_recipe_source, tmp_path):
    """A private copy of a working recipe (runs, baseline and backups stripped) to inject faults into."""
    import shutil

    recipe = tmp_path / "fi"
    shutil.copytree(working_recipe_source, recipe, ignore=shutil.ignore_patterns(".migrator", "res", "baseline"))
    return recipe


def repair_run(recipe: Path, *extra: str, env: dict | None = None):
    """`migrator run RECIPE --json` on a (broken) recipe: returns (process, summary, report)."""
    proc = run_cli("run", str(recipe), "--json", *extra, env=env)
    summary = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    report_file = recipe / "migration_report.json"
    report = json.loads(report_file.read_text()) if report_file.is_file() else {}
    return proc, summary, report


def assert_repaired(recipe: Path, proc, summary: dict, report: dict, rule: str, injected: dict[str, bytes | None]):
    """Repaired by `rule` in round 1, the re-run succeeded, and the round-1 backup holds exactly the
    injected originals (`injected`: recipe-relative path -> bytes, None = file absent)."""
    assert proc.returncode == 0, (proc.stdout[-1500:], proc.stderr[-2500:])
    assert summary["scenario"] == "B" and summary["status"] == "ok", summary
    first = report["rounds"][0]
    assert first["diagnosis"]["rule"] == rule, first["diagnosis"]
    assert first["applied"] and first["diff"]
    assert report["runs"][-1]["ok"]
    assert (recipe / "baseline" / "baseline_metadata.json").is_file()
    backup = recipe / ".migrator" / "backup" / "round_1"
    for rel, content in injected.items():
        if content is None:
            assert not (backup / rel).exists(), rel
        else:
            assert (backup / rel).read_bytes() == content, rel


def first_match_name(recipe: Path, output: str) -> str | None:
    """Name of the catalogue rule that would take this run output (None: no rule)."""
    from agent.failure import Failure
    from agent.repair import first_matching_rule

    matched = first_matching_rule(Failure.from_output(recipe, output))
    return matched[0].name if matched else None
