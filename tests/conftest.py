"""Shared fixtures: tiny local checkpoints (SPEC §5) and a helper to run the CLI for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


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
