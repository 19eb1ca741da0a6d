"""Recipes as people keep them: symlinks to shared folders, special files, odd names, large trees.

Every case runs the `migrator` CLI in a subprocess on a real folder (a copy of a working recipe),
and checks what a user sees — the exit code, exactly one `migrator: error:` line and no traceback —
and what stays true on disk: nothing outside the recipe changed, and nothing blocks a re-run.
Decisions these tests pin down: a symlink out of a recipe is *refused* (one line naming the link,
exit 2) whenever the migrator would write through it; reading through it stays allowed. Files that
are not regular files (FIFOs, devices, loops) are refused by type without being opened for reading.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from migrator_cli import repair_run, run_cli


def _one_error_line(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("migrator:")]
    assert len(lines) == 1 and lines[0].startswith("migrator: error: "), proc.stderr[-3000:]
    return lines[0]


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else b"<dir>")
            for p in sorted(root.rglob("*"))}


def _yaml(recipe: Path) -> Path:
    return next((recipe / "config").glob("*.yaml"))


# ---- symlinks out of the recipe: refused where the migrator would write through them -------------
def test_models_folder_linked_to_a_shared_folder_is_not_repaired_through(working_recipe, tmp_path):
    """models/ is a link to a shared folder whose __init__.py shadows the package: the repair that
    would delete it is refused with one line; the shared folder is untouched."""
    shared = tmp_path / "shared_models"
    shutil.move(working_recipe / "models", shared)
    (working_recipe / "models").symlink_to(shared, target_is_directory=True)
    (shared / "__init__.py").write_text("from .modeling_deepseek import DeepseekV3ForCausalLM\n")
    before = _tree(shared)
    proc, summary, report = repair_run(working_recipe)
    line = _one_error_line(proc)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "models is a symlink to" in line and "outside the recipe" in line, line
    assert _tree(shared) == before
    # The refused round changed nothing: rollback has nothing to restore, and touches nothing outside.
    rolled = run_cli("rollback", str(working_recipe))
    assert rolled.returncode == 0 and "(0 file(s) changed)" in rolled.stdout, rolled.stdout + rolled.stderr
    assert _tree(shared) == before


@pytest.mark.parametrize("what", ["yaml_file", "config_folder"])
def test_yaml_linked_outside_is_not_edited(working_recipe, tmp_path, what):
    """A YAML (or the whole config/) linked to a file outside, with a slip a YAML rule fixes: the
    outside file keeps its bytes and the run stops with one line naming the link."""
    yaml_file = _yaml(working_recipe)
    text = yaml_file.read_text().replace("  batch_size: 1\n", '  batch_size: "1"\n')
    outside = tmp_path / "team_configs"
    outside.mkdir()
    if what == "yaml_file":
        (outside / yaml_file.name).write_text(text)
        yaml_file.unlink()
        yaml_file.symlink_to(outside / yaml_file.name)
        shown = f"config/{yaml_file.name} is a symlink"
    else:
        shutil.rmtree(working_recipe / "config")
        (outside / yaml_file.name).write_text(text)
        (working_recipe / "config").symlink_to(outside, target_is_directory=True)
        shown = "config is a symlink"
    before = _tree(outside)
    proc, summary, report = repair_run(working_recipe)
    line = _one_error_line(proc)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert shown in line and "outside the recipe" in line, line
    assert _tree(outside) == before


def test_baseline_folder_linked_outside_is_refused_before_anything_runs(working_recipe, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (working_recipe / "baseline").symlink_to(elsewhere, target_is_directory=True)
    start = time.monotonic()
    proc = run_cli("run", str(working_recipe))
    line = _one_error_line(proc)
    assert proc.returncode == 2 and "baseline is a symlink" in line and "outside the recipe" in line, line
    assert list(elsewhere.iterdir()) == []
    assert not (working_recipe / ".migrator" / "runs").exists()         # refused before the trial run
    assert time.monotonic() - start < 60


def test_baseline_that_is_a_file_of_the_user_s_is_refused_and_kept(working_recipe):
    (working_recipe / "baseline").write_text("my notes on the baseline\n")
    proc = run_cli("run", str(working_recipe))
    line = _one_error_line(proc)
    assert proc.returncode == 2 and "baseline" in line and "not a folder" in line, line
    assert (working_recipe / "baseline").read_text() == "my notes on the baseline\n"


# ---- files that are not files -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "symlink_loop"])
def test_special_file_where_a_source_is_expected_is_refused_by_type(working_recipe, kind):
    """A FIFO would block a read forever; a link to /dev/zero never ends; a loop cannot be opened."""
    path = working_recipe / "models" / "extra.py"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    else:
        path.symlink_to(path.name)
    start = time.monotonic()
    for command in (["classify", str(working_recipe)], ["run", str(working_recipe)]):
        proc = run_cli(*command, timeout=120)
        line = _one_error_line(proc)
        assert proc.returncode == 2, (command, proc.stderr[-2000:])
        assert "models/extra.py" in line and ("FIFO" in line or "device" in line or "loop" in line), line
    assert time.monotonic() - start < 60


def test_a_folder_named_like_a_module_is_a_folder(working_recipe):
    """A folder called pkg.py is not a source file: the recipe runs (scenario C)."""
    (working_recipe / "pkg.py").mkdir()
    (working_recipe / "models" / "data.py").mkdir()
    proc = run_cli("classify", str(working_recipe))
    assert proc.returncode == 0 and proc.stdout.startswith("C:"), proc.stderr[-2000:]


def test_a_folder_loop_inside_the_recipe_is_not_followed(working_recipe):
    (working_recipe / "models" / "up").symlink_to("..", target_is_directory=True)
    proc = run_cli("classify", str(working_recipe))
    assert proc.returncode == 0 and proc.stdout.startswith("C:"), proc.stderr[-2000:]


# ---- backups copy what a round changes ---------------------------------------------------------------
def test_a_round_backs_up_what_it_changes_not_the_whole_recipe(working_recipe):
    """A recipe with 3,000 data files and a shadowing models/__init__.py: round 1's backup holds the
    one file the fix removed (bytes recorded in the round), and rollback puts it back."""
    data = working_recipe / "data"
    for i in range(30):
        (data / f"shard_{i}").mkdir(parents=True)
        for j in range(100):
            (data / f"shard_{i}" / f"sample_{j}.txt").write_text(f"sample {i} {j}\n" * 20)
    init = working_recipe / "models" / "__init__.py"
    init.write_text("from .modeling_deepseek import DeepseekV3ForCausalLM  # copied from another recipe\n")
    injected = init.read_bytes()
    proc, summary, report = repair_run(working_recipe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    backup = working_recipe / ".migrator" / "backup" / "round_1"
    backed_up = sorted(p.relative_to(backup).as_posix() for p in backup.rglob("*") if p.is_file())
    assert backed_up == ["models/__init__.py"]
    assert report["rounds"][0]["backup_bytes"] == len(injected)
    rolled = run_cli("rollback", str(working_recipe))
    assert rolled.returncode == 0, rolled.stderr
    assert init.read_bytes() == injected
    assert len(list(data.rglob("*.txt"))) == 3000


# ---- repairs a person makes without thinking ----------------------------------------------------------
@pytest.mark.parametrize("line", ["import torch_npu\n", pytest.param("import torchair\n", marks=pytest.mark.slow)])
def test_a_bare_npu_import_is_guarded_on_a_host_without_npu(working_recipe, line):
    """upstream's skill tells every recipe to `import torch_npu`; on a host without a usable NPU the
    fix is the guard, not "install torch_npu" (torchair: the same, when nothing uses it)."""
    modeling = working_recipe / "models" / "modeling_fi.py"
    modeling.write_text(line + modeling.read_text())
    proc, summary, report = repair_run(working_recipe)
    assert proc.returncode == 0, (summary, proc.stderr[-2000:])
    first = report["rounds"][0]
    assert first["diagnosis"]["rule"] == "incidental_npu_call" and first["applied"], first
    # the torch_npu guard catches what a torch_npu without CANN raises too (OSError, RuntimeError)
    assert re.search(r"^try:\n    import (torch_npu|torchair)\nexcept (ImportError|Exception):", modeling.read_text(), re.M)


# one slip by default: all three go through the same diagnosis and fix
@pytest.mark.parametrize("slip", ["\tbatch_size: 1\n", pytest.param("  batch_size:1\n", marks=pytest.mark.slow),
                                  pytest.param("   batch_size: 1\n", marks=pytest.mark.slow)])
def test_a_yaml_formatting_slip_the_diagnosis_names_is_fixed(working_recipe, slip):
    yaml_file = _yaml(working_recipe)
    yaml_file.write_text(yaml_file.read_text().replace("  batch_size: 1\n", slip))
    proc, summary, report = repair_run(working_recipe)
    assert proc.returncode == 0, (summary, proc.stderr[-2000:])
    first = report["rounds"][0]
    assert first["diagnosis"]["rule"] == "recipe_yaml_syntax_error" and first["applied"], first
    assert "  batch_size: 1\n" in yaml_file.read_text()
