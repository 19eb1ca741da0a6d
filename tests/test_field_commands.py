"""Every command on folders as upstream ships them: the same description of a folder from classify,
run and baseline, the exit-4 message (distinct kernels and the first real call), `--json` on every
exit, `--device npu` on a host without one. Runs on a copy of the upstream snapshot
(../shared/upstream/cann-recipes-infer), skipped where it is absent."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import REPO_ROOT, run_cli

UPSTREAM = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"


@pytest.fixture
def upstream(tmp_path):
    if not (UPSTREAM / "executor" / "scripts" / "infer.sh").is_file():
        pytest.skip(f"{UPSTREAM} is absent (the upstream snapshot lives in ../shared)")
    root = tmp_path / "cann-recipes-infer"
    shutil.copytree(UPSTREAM, root, symlinks=True)
    return root


def _error_line(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("migrator:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_exit_4_names_distinct_kernels_and_the_first_real_call(upstream):
    """upstream's qwen calls a score of distinct torch_npu kernels at about a hundred places; the message
    counts kernels (not call sites) and names the first call, not the `import torchair` line."""
    proc = run_cli("run", "models/qwen", cwd=upstream, timeout=300)
    line = _error_line(proc)
    assert proc.returncode == 4, proc.stderr[-2000:]
    head, _, rest = line.partition("needs an Ascend NPU: ")
    kernels, _, after = rest.partition(" torch_npu kernels (")
    names, _, sites = after.partition(") at ")
    assert int(kernels) == len(names.split(", ")) or names.endswith("…"), line
    assert int(kernels) < int(sites.split()[0]), line               # distinct kernels, more call sites
    assert "first call: npu_" in line and "first: torchair" not in line, line
    assert "models/modeling_qwen.py:" in line.split("first call:")[1], line
