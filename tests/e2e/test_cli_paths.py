"""Every command takes relative and absolute paths, `.` and symlinked folders, from any working
directory (the recipe is run by absolute path, never relative to where the user stands)."""

from __future__ import annotations

import json

import pytest

from migrator_cli import run_cli


@pytest.mark.slow
def test_every_command_both_ways_from_another_working_directory(working_recipe, tmp_path):
    recipe = working_recipe                      # tmp_path / "fi"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "link_to_fi"
    link.symlink_to(recipe, target_is_directory=True)

    # classify: relative from the parent folder, and "." from inside the recipe
    for args, cwd in ((["fi"], tmp_path), (["."], recipe)):
        proc = run_cli("classify", *args, cwd=cwd, timeout=600)
        assert proc.returncode == 0 and proc.stdout.startswith("C: infer.sh present and it runs"), \
            (args, proc.stdout, proc.stderr[-2000:])

    # run: relative (../fi) and absolute through a symlink, both from elsewhere
    for target in ("../fi", str(link)):
        proc = run_cli("run", target, "--json", cwd=elsewhere, timeout=900)
        summary = json.loads(proc.stdout)
        assert proc.returncode == 0 and summary["scenario"] == "C" and summary["status"] == "ok", \
            (target, proc.stdout, proc.stderr[-2000:])
        assert summary["recipe_dir"] == str(recipe.resolve())

    # baseline: relative and absolute (symlink)
    for target, cwd in (("fi", tmp_path), (str(link), elsewhere)):
        proc = run_cli("baseline", target, "--summary", str(tmp_path / "summary"), cwd=cwd, timeout=900)
        assert proc.returncode == 0 and "| ok |" in proc.stdout, (target, proc.stdout, proc.stderr[-2000:])
    assert json.loads((recipe / "baseline" / "baseline_metadata.json").read_text())["performance"]["prefill_ms"] > 0

    # rollback: relative and absolute (symlink); a backup made as a repair round would
    from agent.recipe.backup import backup_round

    infer_py = recipe / "infer.py"
    original = infer_py.read_bytes()
    for target, cwd in (("fi", tmp_path), (str(link), elsewhere)):
        with backup_round(recipe, 1):
            infer_py.write_bytes(original + b"# edited\n")
        proc = run_cli("rollback", target, cwd=cwd, timeout=300)
        assert proc.returncode == 0, (target, proc.stdout, proc.stderr)
        assert infer_py.read_bytes() == original
