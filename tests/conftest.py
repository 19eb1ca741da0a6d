"""Fixtures every folder shares: tiny local checkpoints (SPEC §5), a recipe migrated once per session; the e2e
mark of tests/e2e/. Helpers tests import are in tests/support/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from locations import REPO_ROOT
from migrator_cli import run_cli


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


@pytest.fixture(autouse=True)
def environment_left_as_found():
    """Each test leaves the worker's environment as it found it. A test that starts the stand-in's collectives in
    this process sets what a rank sets (GLOO_SOCKET_IFNAME=lo on one host, MASTER_ADDR / MASTER_PORT), and every
    later test's subprocesses would inherit it: two-host ranks then kept loopback as if the user had chosen it."""
    saved = dict(os.environ)
    yield
    if {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"} != \
            {k: v for k, v in saved.items() if k != "PYTEST_CURRENT_TEST"}:
        current = os.environ.get("PYTEST_CURRENT_TEST")
        os.environ.clear()
        os.environ.update({k: v for k, v in saved.items() if k != "PYTEST_CURRENT_TEST"})
        if current is not None:
            os.environ["PYTEST_CURRENT_TEST"] = current


@pytest.fixture(scope="session", autouse=True)
def native_files_pyflakes_clean():
    """pyflakes on every native modeling file the session's tests wrote (tests/support/native_files.py)."""
    import native_files

    patch = pytest.MonkeyPatch()
    native_files.recording(patch)
    yield
    patch.undo()
    found = native_files.findings()
    assert not found, "pyflakes in generated native files: " + "; ".join(found[:20])


E2E = Path(__file__).resolve().parent / "e2e"


@pytest.hookimpl(tryfirst=True)      # before `-m` selects on the marks
def pytest_collection_modifyitems(config, items):
    """Every test under tests/e2e/ carries the e2e mark: `-m "not e2e and not slow"` is the quick run."""
    from budget import slow_for_budget

    for item in items:
        if E2E in item.path.resolve().parents:
            item.add_marker(pytest.mark.e2e)
        if slow_for_budget(item.nodeid):          # tests/support/budget.py: which default case covers it
            item.add_marker(pytest.mark.slow)


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


