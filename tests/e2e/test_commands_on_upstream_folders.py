"""Every command on folders as upstream ships them: the same description of a folder from classify,
run and baseline, the exit-4 message (distinct kernels and the first real call), `--json` on every
exit, `--device npu` on a host without one. Runs on a copy of the upstream snapshot
(../shared/upstream/cann-recipes-infer), skipped where it is absent."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from locations import REPO_ROOT
from migrator_cli import run_cli

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


def _checkout_like(tmp_path: Path) -> Path:
    """A tree shaped like a cann-recipes-infer checkout (its shared entry point and model registry) with
    two model folders that are not recipes: an `hstu`-like one (code, no config/*.yaml) and a README-only one."""
    root = tmp_path / "checkout"
    (root / "executor" / "core").mkdir(parents=True)
    (root / "executor" / "core" / "support_models.py").write_text("SUPPORT_MODELS = {}\n")
    (root / "executor" / "scripts").mkdir(parents=True)
    (root / "executor" / "scripts" / "infer.sh").write_text("#!/bin/bash\necho ran > \"$(dirname $0)/RAN\"\n")
    (root / "models" / "hstu").mkdir(parents=True)
    (root / "models" / "hstu" / "README.md").write_text("# HSTU\n")
    (root / "models" / "hstu" / "modeling_hstu.py").write_text("import torch\n")
    (root / "models" / "readme_only").mkdir()
    (root / "models" / "readme_only" / "README.md").write_text("# a model\n")
    return root


@pytest.mark.parametrize("model", ["hstu", "readme_only"])
def test_a_model_folder_that_is_not_a_recipe_gets_one_answer_from_every_command(tmp_path, model):
    """classify, run and baseline describe the folder the same way (agent.recipe.recipe.Recipe.at):
    one line, exit 2, nothing run or written in the checkout (before: classify "A" exit 0, run
    "no config.json" exit 2, baseline "not a recipe" exit 1)."""
    root = _checkout_like(tmp_path)
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    folder = root / "models" / model
    lines = {}
    for command in ("classify", "run", "baseline"):
        proc = run_cli(command, str(folder), cwd=tmp_path, timeout=120)
        assert proc.returncode == 2, (command, proc.stdout[-1000:], proc.stderr[-2000:])
        lines[command] = _error_line(proc)
    assert len(set(lines.values())) == 1, lines
    line = lines["run"]
    assert str(folder) in line and "not a recipe" in line and "no config/*.yaml" in line, line
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before      # nothing ran, nothing written
