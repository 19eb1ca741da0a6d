"""`migrator` run as a user runs it (a subprocess), and what a repair round must leave behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from locations import REPO_ROOT


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 900, env: dict | None = None):
    """Run `migrator ...` in a subprocess, as a user would."""
    return subprocess.run([sys.executable, "-m", "agent.cli", *args], cwd=cwd or REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


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
    assert_round_backup(recipe, first, injected)


def assert_round_backup(recipe: Path, first_round: dict, injected: dict[str, bytes | None]) -> None:
    """Round 1's backup is copy-on-write: it holds exactly the files the round's diff changed (as
    they were before), and each injected file among them with its injected bytes."""
    import re

    backup = recipe / ".migrator" / "backup" / "round_1"
    changed = set(re.findall(r"^--- a/(.+)$", first_round["diff"], re.M))
    held = {p.relative_to(backup).as_posix() for p in backup.rglob("*") if p.is_file()}
    assert held == changed, (held, changed)
    for rel, content in injected.items():
        if content is None:
            assert not (backup / rel).exists(), rel
        elif rel in held:
            assert (backup / rel).read_bytes() == content, rel


def first_match_name(recipe: Path, output: str) -> str | None:
    """Name of the catalogue rule that would take this run output (None: no rule)."""
    from agent.repair.failure import Failure
    from agent.repair.diagnose import first_matching_rule

    matched = first_matching_rule(Failure.from_output(recipe, output))
    return matched[0].name if matched else None
