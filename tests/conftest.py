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


def _this_checkout_in_every_subprocess() -> None:
    """A subprocess started outside the checkout (`migrator run fi` from the recipe's parent, a
    recipe's infer.sh) imports agent/engine from the installed package. When that is another
    checkout (a virtualenv shared between git worktrees, installed editable from one of them), the
    tests would silently run that code: put a folder linking to this checkout's packages first on
    PYTHONPATH (inherited by every subprocess). Not the checkout root itself: its models/ folder
    must not join the recipes' `models` package."""
    import tempfile

    probe = subprocess.run([sys.executable, "-c", "import agent, engine; print(agent.__file__); print(engine.__file__)"],
                           cwd=tempfile.gettempdir(), capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    found = [Path(p).resolve().parent for p in probe.stdout.split()]
    if probe.returncode == 0 and found == [REPO_ROOT / "agent", REPO_ROOT / "engine"]:
        return
    import hashlib

    links = Path(tempfile.gettempdir()) / f"migrator-checkout-{hashlib.sha1(str(REPO_ROOT).encode()).hexdigest()[:12]}"
    links.mkdir(exist_ok=True)
    for package in ("agent", "engine", "npu_standin"):
        try:
            (links / package).symlink_to(REPO_ROOT / package, target_is_directory=True)
        except FileExistsError:
            pass
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(links), os.environ.get("PYTHONPATH")]))


if not os.environ.get("MIGRATOR_TEST_CHECKOUT_LINKED"):
    os.environ["MIGRATOR_TEST_CHECKOUT_LINKED"] = "1"
    _this_checkout_in_every_subprocess()


def torch_npu_wheel(download: bool = True) -> tuple[Path | None, str]:
    """(folder, "") with the real torch-npu wheel of torch's release pip-installed with --no-deps
    --target into a cache dir reused across runs (~44 MB wheel, ~150 MB unpacked, about 7 s), or
    (None, why not). Without CANN its import fails for real (libhccl.so)."""
    import platform
    import shutil
    from importlib.metadata import version

    if sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
        return None, "torch-npu wheels exist for Linux x86_64/aarch64 only"
    release = version("torch").split("+", 1)[0]
    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    target = cache_root / "infer-migrator" / f"torch-npu-{release}-py{sys.version_info[0]}{sys.version_info[1]}"
    if (target / ".complete").exists():
        return target, ""
    if not download:
        return None, f"torch-npu=={release} is not in {target.parent}"
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input", "--quiet",
           "--disable-pip-version-check", "--timeout", "30", "--target", str(tmp), f"torch-npu=={release}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return None, f"could not pip install torch-npu=={release}: {exc}"
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        return None, f"pip cannot install torch-npu=={release} (package index unreachable or no such release): {tail}"
    (tmp / ".complete").write_text(release + "\n")
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(target)
    except OSError:             # another worker got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return target, ""


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Factory: model_type -> directory of a tiny checkpoint, built once per session."""
    from agent.testing.tiny_checkpoint import build_tiny_checkpoint

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
