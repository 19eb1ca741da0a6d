"""Answers in the right class (SPEC §6): a file the filesystem will not let us write (EPERM: an immutable
file, EROFS: a read-only mount, EACCES) is exit 74 wherever the write happens, never "a fix could not be
applied" (exit 1) or a usage error (exit 2). The tokenizer and upstream-YAML cases are rows of
tests/e2e/test_bad_input.py."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from agent import errors


def _journal_recipe(tmp_path: Path) -> Path:
    recipe = tmp_path / "recipe"
    backups = recipe / ".migrator" / "backup"
    (backups / "round_1").mkdir(parents=True)
    (backups / "round_1" / "infer.sh").write_text("before\n")
    (backups / "round_1.journal").write_text(json.dumps({"path": "infer.sh", "was": "file", "mode": 0o755}) + "\n")
    (recipe / "infer.sh").write_text("after\n")
    return recipe


@pytest.fixture
def immutable(tmp_path):
    """chattr +i on a path (root on ext4), undone after the test; skipped where the filesystem has no such flag."""
    made = []

    def make(path: Path) -> Path:
        proc = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True) \
            if shutil.which("chattr") else None
        if proc is None or proc.returncode != 0:
            pytest.skip("chattr +i is not available here")
        made.append(path)
        return path
    yield make
    for path in made:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)


def test_rollback_onto_an_immutable_file_is_exit_74(tmp_path, immutable, capsys):
    from agent.cli import main

    recipe = _journal_recipe(tmp_path)
    immutable(recipe / "infer.sh")
    code = main(["rollback", str(recipe)])
    err = capsys.readouterr().err
    assert code == errors.EXIT_FILESYSTEM, err
    assert len(err.strip().splitlines()) == 1 and "cannot be written" in err and "Traceback" not in err
    assert "--resume" not in err           # rollback has no --resume: the advice names only what it takes
    assert (recipe / "infer.sh").read_text() == "after\n"


@pytest.mark.parametrize("command", ["run", "baseline"])
def test_the_exit_74_advice_is_what_the_command_takes(tmp_path, immutable, capsys, command):
    """An immutable recipe folder: exit 74 for `run` and `baseline`; following the advice works — `run` names
    --resume (it takes it), `baseline` does not (it would be a usage error)."""
    from agent.cli import main

    recipe = tmp_path / "recipe"
    (recipe / "config").mkdir(parents=True)
    (recipe / "infer.sh").write_text("#!/bin/bash\necho never run\n")
    (recipe / "config" / "r_1card_eager.yaml").write_text("model_name: r\n")
    immutable(recipe)
    argv = ["run", str(recipe), "--device", "cpu"] if command == "run" else \
        ["baseline", str(recipe), "--summary", str(tmp_path / "out" / "summary")]
    code = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if not ln.startswith("[migrator]")]
    assert code == errors.EXIT_FILESYSTEM and len(lines) == 1 and "cannot be written" in lines[0], err
    assert ("--resume" in lines[0]) == (command == "run"), lines[0]


@pytest.mark.parametrize("code", [errno.EPERM, errno.EROFS, errno.EACCES])
def test_a_repair_that_meets_an_unwritable_file_is_exit_74_not_a_failed_fix(tmp_path, monkeypatch, code):
    """The fix's own `except Exception` used to swallow it ("could not be applied", exit 1)."""
    import agent.repair.fix as fix_mod
    from agent.repair.rules.rule import Kind, Rule

    recipe = tmp_path / "recipe"
    (recipe / "config").mkdir(parents=True)
    target = recipe / "config" / "x.yaml"
    target.write_text("model_name: x\n")

    def fix(failure, facts, ctx):
        raise OSError(code, "refused", str(target))

    rule = Rule("fake_rule", None, "fake", fix, facts=lambda failure, found: {}, kind=Kind.YAML)
    monkeypatch.setattr(fix_mod, "rule_named", lambda name: rule)
    with pytest.raises(errors.FilesystemFault) as info:
        fix_mod.repair(recipe, {"rule": "fake_rule", "facts": {}, "error": "x"}, 1)
    assert info.value.exit_code == errors.EXIT_FILESYSTEM and str(target) in str(info.value)


def test_a_fix_that_fails_for_its_own_reasons_is_still_reported_not_74(tmp_path, monkeypatch):
    import agent.repair.fix as fix_mod
    from agent.repair.rules.rule import Kind, Rule

    recipe = tmp_path / "recipe"
    recipe.mkdir()

    def fix(failure, facts, ctx):
        raise KeyError("no such key")

    rule = Rule("fake_rule", None, "fake", fix, facts=lambda failure, found: {}, kind=Kind.YAML)
    monkeypatch.setattr(fix_mod, "rule_named", lambda name: rule)
    got = fix_mod.repair(recipe, {"rule": "fake_rule", "facts": {}, "error": "x"}, 1)
    assert "could not be applied" in got["note"] and not got["applied"]
