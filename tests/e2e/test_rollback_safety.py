"""Backups and rollback never lose a file.

A round's backup is copy-on-write: each file is copied (temporary file + rename, journalled) just
before the round first changes it, so the backup holds what the round changed and nothing else, and
it is never retaken on --resume. Rollback undoes what the rounds' journals list, never through a
symlink, moves what it replaces or what a round created into .migrator/trash/<time>/, and leaves
files no repair touched alone. The report never writes through a symlink.
In-process tests use a small recipe-like folder; the kill tests run `migrator run` for real.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from locations import REPO_ROOT
from migrator_cli import repair_run, run_cli

from agent.repair import fix as repair_mod
from agent.errors import InputError
from agent.recipe.backup import backup_round, recipe_files, rollback, start_backup_run
from agent.recipe.fs_guard import WriteOutsideRecipe
from agent.repair.rules.rule import Rule


@pytest.fixture
def recipe(tmp_path):
    root = tmp_path / "rec"
    (root / "models").mkdir(parents=True)
    (root / "infer.sh").write_bytes(b"#!/bin/bash\r\necho hi\r\n")
    os.chmod(root / "infer.sh", 0o755)
    (root / "runner_x.py").write_bytes(b"print('original runner')\n")
    (root / "models" / "modeling_x.py").write_bytes(b"class M: ...\n")
    return root


def _snapshot(root):
    return {rel: (p.read_bytes(), os.lstat(p).st_mode) for rel, p in recipe_files(root).items()}


def _trash_files(root):
    trash = root / ".migrator" / "trash"
    return sorted(p.relative_to(trash).as_posix() for p in trash.rglob("*") if p.is_file() or p.is_symlink())


class Killed(BaseException):
    """What SIGKILL does to the node, in process: the fix stops halfway and nothing catches it."""


def _rule(fix):
    return Rule("test_rule", None, "test rule", fix, facts=lambda failure, found: {}, kind="codemod")


def _backed_up(dest):
    return sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())


def test_backup_copies_what_the_round_changes_once_and_is_reused_by_the_same_run(recipe):
    original = _snapshot(recipe)
    with backup_round(recipe, 1) as first:
        assert not first.resumed and first.dir.name == "round_1"
        (recipe / "runner_x.py").write_bytes(b"repaired\n")
        (recipe / "runner_x.py").write_bytes(b"repaired twice\n")     # copied once, before the first write
    with backup_round(recipe, 1) as again:
        assert again.resumed and again.dir == first.dir
    assert (first.dir / "runner_x.py").read_bytes() == original["runner_x.py"][0]
    assert _backed_up(first.dir) == ["runner_x.py"]                 # not infer.sh, not models/
    assert first.bytes_copied == len(original["runner_x.py"][0])
    assert not [p for p in first.dir.parent.iterdir() if p.name.startswith(".round_")]   # no temporary left


def test_repair_killed_halfway_then_resumed_keeps_the_original(recipe, monkeypatch):
    original = _snapshot(recipe)

    def half_fix(failure, facts, ctx):
        (recipe / "runner_x.py").write_bytes(b"print('half")          # torn write
        (recipe / "helper.py").write_bytes(b"created by the fix\n")
        raise Killed()

    def fix(failure, facts, ctx):
        runner = recipe / "runner_x.py"
        runner.write_bytes(runner.read_bytes().replace(b"original", b"repaired"))
        return "fixed"

    monkeypatch.setattr(repair_mod, "rule_named", lambda name: _rule(half_fix))
    with pytest.raises(Killed):
        repair_mod.repair(recipe, {"rule": "test_rule"}, round_no=1)
    monkeypatch.setattr(repair_mod, "rule_named", lambda name: _rule(fix))
    result = repair_mod.repair(recipe, {"rule": "test_rule"}, round_no=1)     # what --resume does
    assert result["applied"] and "+print('repaired runner')" in result["diff"] and "half" not in result["diff"]
    assert (recipe / "runner_x.py").read_bytes() == b"print('repaired runner')\n"
    backup = recipe / ".migrator" / "backup" / "round_1"
    assert (backup / "runner_x.py").read_bytes() == original["runner_x.py"][0]
    assert "helper.py" in " ".join(_trash_files(recipe))          # the torn attempt is kept, not deleted
    rollback(recipe, 1)
    assert _snapshot(recipe) == original


def test_a_fresh_run_keeps_the_earlier_runs_backups(recipe):
    first = (recipe / "runner_x.py").read_bytes()
    with backup_round(recipe, 1):
        (recipe / "runner_x.py").write_bytes(b"repaired by the first run\n")
    (recipe / "runner_x.py").write_bytes(b"edited by the user later\n")
    start_backup_run(recipe, "second-run")
    with backup_round(recipe, 1) as second:
        assert not second.resumed
        (recipe / "runner_x.py").write_bytes(b"repaired by the second run\n")
    assert (second.dir / "runner_x.py").read_bytes() == b"edited by the user later\n"
    earlier = list((recipe / ".migrator" / "backup" / "earlier").glob("*/round_1/runner_x.py"))
    assert len(earlier) == 1 and earlier[0].read_bytes() == first
    with backup_round(recipe, 1) as resumed:                       # --resume of the second run
        assert resumed.resumed and resumed.dir == second.dir


def test_rollback_undoes_the_round_keeps_mode_and_line_endings_and_leaves_the_user_s_files(recipe):
    original = _snapshot(recipe)
    with backup_round(recipe, 1):
        (recipe / "infer.sh").write_bytes(b"#!/bin/bash\nexport X=1\necho hi\n")
        os.chmod(recipe / "infer.sh", 0o644)
        (recipe / "helper.py").write_text("created by the fix\n")
        (recipe / "models" / "modeling_x.py").unlink()
    (recipe / "notes.txt").write_text("the user's own notes, written after the repair\n")
    round_no, changes = rollback(recipe)
    assert (recipe / "notes.txt").read_text() == "the user's own notes, written after the repair\n"
    (recipe / "notes.txt").unlink()
    assert round_no == 1 and _snapshot(recipe) == original
    trash = _trash_files(recipe)
    assert any(t.endswith("/helper.py") for t in trash) and any(t.endswith("/infer.sh") for t in trash)
    assert any(c.startswith("moved helper.py (created by the repair) to .migrator/trash/") for c in changes)


def test_rollback_undoes_later_rounds_too(recipe):
    original = _snapshot(recipe)
    with backup_round(recipe, 1):
        (recipe / "runner_x.py").write_bytes(b"round 1\n")
    with backup_round(recipe, 2):
        (recipe / "runner_x.py").write_bytes(b"round 2\n")
        (recipe / "models" / "modeling_x.py").write_bytes(b"round 2\n")
    rollback(recipe, 2)
    assert (recipe / "runner_x.py").read_bytes() == b"round 1\n"
    rollback(recipe, 1)
    assert _snapshot(recipe) == original


def _run(recipe, run_id: str, round_fix=None) -> None:
    """What a fresh `migrator run` of the recipe does to its backups: a new run, then (if it repairs) round 1."""
    start_backup_run(recipe, run_id)
    if round_fix is not None:
        with backup_round(recipe, 1):
            round_fix()


def test_newcomer_f4_a_run_that_repaired_nothing_leaves_nothing_to_roll_back(recipe, capsys):
    """Newcomer F4: run (round 1 repaired the YAML) -> rollback -> the user fixes the YAML by hand and breaks
    another file -> run (no repair) -> rollback re-applied round 1 and replaced the user's YAML. Now refused."""
    from agent.cli import main

    yaml = recipe / "config.yaml"
    yaml.write_text("input_max_length: 480\n")                                  # the broken YAML
    _run(recipe, "run-1", lambda: yaml.write_text("input_max_len: 480\n"))    # repaired by round 1
    assert main(["rollback", str(recipe)]) == 0
    assert yaml.read_text() == "input_max_length: 480\n"
    yaml.write_text("input_max_len: 512\n")                                    # the user's own fix
    (recipe / "runner_x.py").write_text("broken by the user\n")
    _run(recipe, "run-2")                                                       # fails, repairs nothing
    capsys.readouterr()
    assert main(["rollback", str(recipe)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "the last run made no repair; the rounds of an earlier run were rolled back" in err[0], err
    assert yaml.read_text() == "input_max_len: 512\n"
    assert (recipe / "runner_x.py").read_text() == "broken by the user\n"


@pytest.mark.parametrize("case", ["rolled_back_twice", "round_of_an_earlier_run", "round_undone_by_number",
                                  "edited_after_the_repair", "earlier_run_then_a_baseline"])
def test_rollback_applies_only_the_latest_runs_rounds_once_and_over_nothing_changed_since(recipe, case):
    """Variants of F4, each refused in one line that names what it would overwrite, nothing changed."""
    yaml = recipe / "config.yaml"
    yaml.write_text("broken: 1\n")
    _run(recipe, "run-1", lambda: yaml.write_text("repaired: 1\n"))
    if case == "rolled_back_twice":
        rollback(recipe)
        yaml.write_text("the user's: 1\n")
        with pytest.raises(InputError, match="rolled back already"):
            rollback(recipe)
    elif case == "round_of_an_earlier_run":              # no rollback between: the next run repaired nothing
        yaml.write_text("the user's: 1\n")
        _run(recipe, "run-2")
        with pytest.raises(InputError, match=r"the last run made no repair; round\(s\) \[1\] are of an earlier run, "
                                             r"and undoing them would overwrite config.yaml"):
            rollback(recipe, 1)
    elif case == "round_undone_by_number":
        with backup_round(recipe, 2):
            (recipe / "runner_x.py").write_bytes(b"round 2\n")
        rollback(recipe, 2)
        with pytest.raises(InputError, match="round 2 were rolled back already"):
            rollback(recipe, 2)
        rollback(recipe, 1)                              # round 1 of the same run is still there to undo
        assert yaml.read_text() == "broken: 1\n"
        return
    elif case == "edited_after_the_repair":
        yaml.write_text("the user's: 1\n")
        with pytest.raises(InputError, match=r"would overwrite config.yaml \(round 1\), changed since the repair"):
            rollback(recipe)
        assert yaml.read_text() == "the user's: 1\n"
        rollback(recipe, force=True)                      # asked for: the user's version goes to the trash
        assert yaml.read_text() == "broken: 1\n"
        assert any(t.endswith("/config.yaml") for t in _trash_files(recipe))
        return
    else:                                                 # `migrator baseline` is a run too: it repaired nothing
        _run(recipe, "baseline-run")
        with pytest.raises(InputError, match="the last run made no repair"):
            rollback(recipe)
        assert yaml.read_text() == "repaired: 1\n"
        return
    assert yaml.read_text() == "the user's: 1\n"


def test_a_round_never_writes_through_a_symlink_out_of_the_recipe(recipe, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.py"
    victim.write_bytes(b"outside, must not change\n")
    (outside / "__init__.py").write_bytes(b"shared\n")
    (recipe / "secret.py").symlink_to(victim)
    (recipe / "shared").symlink_to(outside, target_is_directory=True)
    import shutil

    for attempt in (lambda: (recipe / "secret.py").write_bytes(b"x"),
                    lambda: open(recipe / "secret.py", "a").close(),
                    lambda: (recipe / "shared" / "__init__.py").unlink(),
                    lambda: (recipe / "shared" / "new.py").write_text("x"),
                    lambda: os.replace(recipe / "runner_x.py", recipe / "shared" / "runner_x.py"),
                    lambda: (recipe / "secret.py").unlink(),
                    lambda: shutil.rmtree(recipe / "shared" / "."),
                    lambda: os.chmod(recipe / "secret.py", 0o600)):
        with backup_round(recipe, 1), pytest.raises(WriteOutsideRecipe, match="outside the recipe"):
            attempt()
    assert victim.read_bytes() == b"outside, must not change\n"
    assert sorted(p.name for p in outside.iterdir()) == ["__init__.py", "victim.py"]
    assert (recipe / "runner_x.py").is_file() and (recipe / "secret.py").is_symlink()


def test_rollback_never_writes_through_a_symlink(recipe, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.py"
    victim.write_bytes(b"outside, must not change\n")
    (outside / "modeling_x.py").write_bytes(b"outside modeling\n")
    (recipe / "secret").symlink_to(victim)                     # a link present at backup time
    original = _snapshot(recipe)
    with backup_round(recipe, 1) as round_backup:
        (recipe / "runner_x.py").write_bytes(b"repaired\n")
        (recipe / "models" / "modeling_x.py").write_bytes(b"repaired\n")
    assert not (round_backup.dir / "secret").exists()
    # After the repair, a file and a folder of the recipe became links out of it.
    (recipe / "runner_x.py").unlink()
    (recipe / "runner_x.py").symlink_to(victim)
    os.rename(recipe / "models", tmp_path / "old_models")
    (recipe / "models").symlink_to(outside, target_is_directory=True)
    with pytest.raises(InputError, match="would overwrite models/modeling_x.py .round 1., runner_x.py"):
        rollback(recipe, 1)                                      # changed since the round: named, nothing done
    assert (recipe / "runner_x.py").is_symlink() and (recipe / "models").is_symlink()
    rollback(recipe, 1, force=True)
    assert victim.read_bytes() == b"outside, must not change\n"
    assert (outside / "modeling_x.py").read_bytes() == b"outside modeling\n"
    assert not (recipe / "runner_x.py").is_symlink() and not (recipe / "models").is_symlink()
    assert _snapshot(recipe) == original
    assert (recipe / "secret").is_symlink()                      # a link is not the rollback's to remove
    trash = _trash_files(recipe)
    assert any(t.endswith("/runner_x.py") for t in trash) and any(t.endswith("/models") for t in trash)


def test_a_full_backup_of_an_earlier_release_is_still_restored(recipe):
    """Releases before copy-on-write copied every file and listed them in round_N.manifest.json."""
    import shutil

    original = _snapshot(recipe)
    backups = recipe / ".migrator" / "backup"
    shutil.copytree(recipe, backups / "round_1", ignore=shutil.ignore_patterns(".migrator"))
    (backups / "round_1.manifest.json").write_text(json.dumps(sorted(recipe_files(recipe))))
    (recipe / "runner_x.py").write_bytes(b"repaired\n")
    (recipe / "added_by_fix.py").write_text("x\n")
    rollback(recipe)
    assert _snapshot(recipe) == original


def test_a_symlinked_backup_file_is_refused(recipe, tmp_path):
    with backup_round(recipe, 1) as round_backup:
        (recipe / "runner_x.py").write_bytes(b"repaired\n")
    dest = round_backup.dir
    (dest / "runner_x.py").unlink()
    (dest / "runner_x.py").symlink_to("/etc/hostname")
    with pytest.raises(InputError, match="not a regular file"):
        rollback(recipe, 1)
    assert (recipe / "runner_x.py").read_bytes() == b"repaired\n"


@pytest.mark.parametrize("case", ["no_backups", "only_stray_round_x", "missing_round", "manifest_escapes",
                                  "manifest_not_json", "manifest_into_migrator", "stray_and_valid"])
def test_rollback_bad_input_is_one_line_exit_2(recipe, capsys, case):
    from agent.cli import main

    backups = recipe / ".migrator" / "backup"
    args = ["rollback", str(recipe)]
    journal = backups / "round_1.journal"
    if case != "no_backups":
        with backup_round(recipe, 1):
            (recipe / "runner_x.py").write_bytes(b"changed\n")
    else:
        (recipe / "runner_x.py").write_bytes(b"changed\n")
    if case in ("only_stray_round_x", "stray_and_valid"):
        (backups / "round_x").mkdir(parents=True, exist_ok=True)
        (backups / "round_").mkdir()
        (backups / "round_2.manifest.json").write_text("[]")      # a manifest without its folder
        if case == "only_stray_round_x":
            os.rename(backups / "round_1", backups / "round_1_old")
    if case == "missing_round":
        args += ["--round", "7"]
    entry = lambda rel: json.dumps({"path": rel, "was": "absent"}) + "\n"   # noqa: E731
    if case == "manifest_escapes":
        journal.write_text(journal.read_text() + entry("../../escape.py"))
    if case == "manifest_not_json":
        journal.write_text("{\n" + journal.read_text())
    if case == "manifest_into_migrator":
        journal.write_text(journal.read_text() + entry(".migrator/threads.json"))
    code = main(args)
    captured = capsys.readouterr()
    if case == "stray_and_valid":
        assert code == 0 and (recipe / "runner_x.py").read_bytes() == b"print('original runner')\n"
        return
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("migrator: error: "), captured.err
    assert (recipe / "runner_x.py").read_bytes() == b"changed\n"          # nothing restored
    assert not (recipe.parent / "escape.py").exists()


@pytest.mark.parametrize("name", ["migration_report.json", "migration_summary.md", "README.md"])
def test_report_never_writes_through_a_symlink(recipe, tmp_path, name):
    from agent.workflow.report import write_report

    victim = tmp_path / "victim.txt"
    victim.write_text("outside\n")
    (recipe / name).symlink_to(victim)
    with pytest.raises(InputError, match="symlink"):
        write_report({"recipe_dir": str(recipe), "status": "ok", "scenario": "B"})
    assert victim.read_text() == "outside\n"


def test_report_writes_keep_the_readme_mode(recipe):
    from agent.workflow.report import write_report

    (recipe / "README.md").write_text("# x\n")
    os.chmod(recipe / "README.md", 0o640)
    baseline = recipe / "baseline" / "baseline_metadata.json"
    baseline.parent.mkdir(exist_ok=True)
    baseline.write_text("{}")
    # The README gets a status block only when a baseline was written.
    write_report({"recipe_dir": str(recipe), "status": "ok", "scenario": "B", "baseline_path": str(baseline)})
    assert "Migration status" in (recipe / "README.md").read_text()
    assert (os.stat(recipe / "README.md").st_mode & 0o777) == 0o640
    assert json.loads((recipe / "migration_report.json").read_text())["status"] == "ok"


# ---- SIGKILL at each node, then --resume, then rollback (real runs) ---------------------------
def _inject_shadowing_init(recipe):
    """A fault the `models_init_shadows_package` rule repairs (by removing the file)."""
    init = recipe / "models" / "__init__.py"
    init.write_text("from .modeling_deepseek import DeepseekV3ForCausalLM  # copied from another recipe\n")


def _run_until(recipe, node):
    cmd = [sys.executable, "-m", "agent.cli", "run", str(recipe), "--json"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith(f"[migrator] {node} ..."):
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)[-2000:]


def _forget_the_repair_step(recipe):
    """Make the store say what it says when the kill lands inside the repair node after its fix
    wrote the recipe (the node's result never reached the store): drop the checkpoint taken after
    repair and the repair task's writes, so --resume runs repair again on a repaired recipe."""
    import sqlite3

    conn = sqlite3.connect(str(recipe / ".migrator" / "checkpoints.sqlite"))
    ids = [row[0] for row in conn.execute("SELECT checkpoint_id FROM checkpoints ORDER BY checkpoint_id DESC")]
    conn.execute("DELETE FROM checkpoints WHERE checkpoint_id = ?", (ids[0],))
    conn.execute("DELETE FROM writes WHERE checkpoint_id IN (?, ?)", (ids[0], ids[1]))
    conn.commit()
    conn.close()


@pytest.mark.parametrize("node", [
    pytest.param("repair_after_fix", marks=pytest.mark.slow),   # scripts/signal_matrix.py runs every node
    pytest.param("repair", marks=pytest.mark.slow),
    pytest.param("diagnose", marks=pytest.mark.slow),
    pytest.param("trial_run", marks=pytest.mark.slow),
])
def test_sigkill_at_node_then_resume_then_rollback_returns_the_injected_bytes(working_recipe, node):
    _inject_shadowing_init(working_recipe)
    injected = _snapshot(working_recipe)
    if node == "repair_after_fix":
        _run_until(working_recipe, "trial_run")
        assert not (working_recipe / "models" / "__init__.py").exists()      # the fix was applied
        _forget_the_repair_step(working_recipe)
        node = "repair"
    else:
        _run_until(working_recipe, node)
    proc, summary, report = repair_run(working_recipe, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming at {node}" in proc.stderr and summary["status"] == "ok"
    assert [r["diagnosis"]["rule"] for r in report["rounds"]] == ["models_init_shadows_package"]
    assert not (working_recipe / "models" / "__init__.py").exists()
    backup = working_recipe / ".migrator" / "backup" / "round_1" / "models" / "__init__.py"
    assert backup.read_bytes() == injected["models/__init__.py"][0]
    rolled = run_cli("rollback", str(working_recipe))
    assert rolled.returncode == 0, rolled.stderr
    # the migrator's records (report, summary, the README's status block) are not a repair's changes
    records = ("migration_report.json", "migration_summary.md", "README.md")
    assert {k: v for k, v in _snapshot(working_recipe).items() if k not in records} == \
        {k: v for k, v in injected.items() if k not in records}
