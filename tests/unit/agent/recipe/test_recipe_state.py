"""A recipe's own state is untrusted input (SPEC §6): a received recipe's journals, manifests, reports and
registry records are schema-checked; modes are permission bits only; paths and link targets stay inside the
recipe. The table rows (tests/e2e/test_bad_input.py, rollback_*) run the CLI; here: the one place each is
enforced, and a small hypothesis pass over journal entries built from pieces no row lists."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from agent.recipe.backup import BackupError, atomic_write, read_journal, rollback


@pytest.mark.parametrize("mode", [0o4755, 0o2755, 0o1777, 0o6777, 0o7755])
def test_atomic_write_never_sets_setuid_setgid_or_sticky(tmp_path, mode):
    target = tmp_path / "f"
    atomic_write(target, b"x", mode, root=tmp_path)
    assert stat.S_IMODE(os.lstat(target).st_mode) == mode & 0o777


def _recipe(tmp_path: Path, journal: list[dict], saved: dict[str, bytes]) -> Path:
    recipe = tmp_path / "recipe"
    backups = recipe / ".migrator" / "backup"
    (backups / "round_1").mkdir(parents=True)
    (recipe / "infer.sh").write_text("now\n")
    for rel, data in saved.items():
        (backups / "round_1" / rel).parent.mkdir(parents=True, exist_ok=True)
        (backups / "round_1" / rel).write_bytes(data)
    (backups / "round_1.journal").write_text("".join(json.dumps(e) + "\n" for e in journal))
    return recipe


def test_a_legitimate_round_still_rolls_back_with_its_permission_bits(tmp_path):
    recipe = _recipe(tmp_path, [{"path": "infer.sh", "was": "file", "mode": 0o750},
                                {"path": "models/x.py", "was": "link", "target": "../infer.sh"}], {"infer.sh": b"before\n"})
    rollback(recipe)
    assert (recipe / "infer.sh").read_bytes() == b"before\n"
    assert stat.S_IMODE((recipe / "infer.sh").stat().st_mode) == 0o750
    assert os.readlink(recipe / "models" / "x.py") == "../infer.sh"


def test_a_full_backup_file_with_setuid_is_restored_without_it(tmp_path):
    """An earlier release's full backup (manifest): the mode comes from the saved copy itself."""
    recipe = tmp_path / "recipe"
    backups = recipe / ".migrator" / "backup"
    (backups / "round_1").mkdir(parents=True)
    saved = backups / "round_1" / "infer.sh"
    saved.write_text("before\n")
    os.chmod(saved, 0o4755)
    (backups / "round_1.manifest.json").write_text(json.dumps(["infer.sh"]))
    (recipe / "infer.sh").write_text("now\n")
    rollback(recipe)
    assert stat.S_IMODE((recipe / "infer.sh").stat().st_mode) == 0o755


def test_a_report_field_of_the_wrong_shape_is_never_used(tmp_path):
    from agent.recipe.recipe import Recipe, checked_report

    forged = {"model_name": "x", "rendered": ["../../outside.py"], "transformers": {"python": 5, "version": "5.0.0"},
              "vendored": {"files": {"a": "/etc/passwd"}}, "model_dir": ["not", "a", "path"], "other": {"kept": 1}}
    got = checked_report(forged)
    assert got == {"model_name": "x", "other": {"kept": 1}}
    assert checked_report(["not", "an", "object"]) == {}
    (tmp_path / "migration_report.json").write_text(json.dumps(forged))
    assert "rendered" not in Recipe.at(tmp_path).report()


def test_a_registry_record_naming_another_file_edits_nothing(tmp_path):
    from agent.errors import InputError
    from agent.recipe.registry import RECORD, unregister

    victim = tmp_path / "victim.py"
    victim.write_text("a = 1\nLINE = 2\n")
    state = tmp_path / "recipe" / ".migrator"
    state.mkdir(parents=True)
    (state / RECORD).write_text(json.dumps({"registry": str(victim), "inserted": "LINE = 2\n", "offset": 6}))
    with pytest.raises(InputError, match="edits no other file"):
        unregister(state)
    assert victim.read_text() == "a = 1\nLINE = 2\n"


def test_a_journal_entry_for_the_recipe_folder_itself_is_refused(tmp_path):
    journal = tmp_path / "round_1.journal"
    for rel in (".", "", "./", "a/./b", "a//b"):
        journal.write_text(json.dumps({"path": rel, "was": "dir"}) + "\n")
        with pytest.raises(BackupError, match="not a recipe file path"):
            read_journal(journal)


PATH_PIECES = st.sampled_from(["a", "b.py", "..", ".", "/", "//", "\\", "\x00", "\n", ".migrator", "models", "~",
                               "%2e%2e", "C:"])
MODES = st.one_of(st.integers(-1, 0o17777), st.sampled_from([0o4755, 0o2644, 0o1777, 2**31, 2**64]), st.booleans(),
                  st.text(max_size=4), st.none(), st.floats(allow_nan=False))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["file", "link", "absent", "dir", "fifo"]),
                          st.lists(PATH_PIECES, min_size=1, max_size=5), MODES,
                          st.lists(PATH_PIECES, min_size=1, max_size=6)), min_size=1, max_size=5))
def test_fuzz_whatever_a_journal_holds_only_safe_entries_are_accepted(tmp_path, raw):
    entries = []
    for kind, path_parts, mode, target_parts in raw:
        entry = {"path": "/".join(path_parts) if len(path_parts) % 2 else "".join(path_parts), "was": kind}
        if kind == "file":
            entry["mode"] = mode
        if kind == "link":
            entry["target"] = "/".join(target_parts)
        entries.append(entry)
    journal = tmp_path / f"j{abs(hash(json.dumps(entries, default=str)))}.journal"
    journal.write_text("".join(json.dumps(e, default=str) + "\n" for e in entries))
    try:
        accepted = read_journal(journal)
    except BackupError as exc:
        assert "\n" not in str(exc)
        return
    for entry in accepted:
        rel = entry["path"]
        assert not os.path.isabs(rel) and ".." not in rel.split("/") and "\\" not in rel and "\x00" not in rel
        assert not rel.split("/")[0] == ".migrator"
        if "mode" in entry:
            assert isinstance(entry["mode"], int) and not isinstance(entry["mode"], bool)
            assert 0 <= entry["mode"] <= 0o777
        if "target" in entry:
            joined = os.path.normpath(os.path.join(os.path.dirname(rel), entry["target"]))
            assert not os.path.isabs(entry["target"]) and not joined.startswith("..")
