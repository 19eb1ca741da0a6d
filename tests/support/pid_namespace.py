"""Commands run in a pid namespace of their own, as a container or a CI job sharing this host's filesystem
runs them: `unshare --pid --fork --mount-proc` (under a user namespace where this user may not make one)."""

from __future__ import annotations

import functools
import subprocess

import pytest


@functools.lru_cache(maxsize=None)
def _prefix() -> tuple[str, ...] | None:
    for prefix in (("unshare", "--pid", "--fork", "--kill-child", "--mount-proc"),
                   ("unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child", "--mount-proc")):
        try:
            probe = subprocess.run([*prefix, "sh", "-c", "echo $$"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0 and probe.stdout.strip() == "1":
            return prefix
    return None


def in_other_pid_namespace(command: list[str]) -> list[str]:
    """`command` run in a new pid namespace (its first process is pid 1 there); the test is skipped where
    this host lets this user make none."""
    prefix = _prefix()
    if prefix is None:
        pytest.skip("unshare --pid --fork --mount-proc is not allowed here")
    return [*prefix, *command]
