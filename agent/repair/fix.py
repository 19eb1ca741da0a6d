"""Repair: apply the matched rule's fix to the recipe, with a backup first, and record the diff.

Copy-on-write: each file is backed up just before the fix first changes it (agent.recipe.backup),
and a write through a symlink out of the recipe is refused (agent.recipe.fs_guard); whatever the fix
wrote, the user's files keep their line endings, encoding, BOM and mode (agent.recipe.textfile).
"""

from __future__ import annotations

from pathlib import Path

from agent.recipe.backup import backup_round, diff_against_backup, record_after, round_originals, undo_rounds
from agent.recipe.fs_guard import WriteOutsideRecipe
from engine.safe_write import WriteRefused

from agent.recipe.textfile import restore_formats
from agent.records import Diagnosis, Round, Run
from agent.repair.diagnose import rule_named
from agent.repair.failure import Failure
from agent.repair.rules.rule import RepairContext


def repair(recipe_dir: Path, diagnosis: Diagnosis, round_no: int, context: RepairContext | None = None,
           failure: Failure | None = None, run: Run | None = None) -> Round:
    """Apply the matched rule's fix with a backup first; record the diff. The fix gets the full
    failure diagnose saw: `failure`, else rebuilt from the run record `run` (without either, only
    the diagnosis's error line and location)."""
    context = context or RepairContext()
    rule = rule_named(diagnosis.get("rule"))
    if rule is None:
        return {"applied": False, "diff": "", "note": "no repair rule matched"}
    if failure is None:
        failure = Failure.from_run(recipe_dir, run) if run else \
            Failure(recipe_dir, "", diagnosis.get("error", ""), diagnosis.get("location"))
    # A stand-in run's copy of the YAML (agent.run.plan: in our state folder, which backups skip) is what a
    # YAML fix of that run edits, upstream's own file never: its change is the round's diff too.
    run_copy = _run_copy(recipe_dir, failure.yaml)
    copy_before = run_copy.read_bytes() if run_copy is not None else None
    # Copy-on-write: each file is backed up just before the fix first changes it, and a write that
    # would land outside the recipe (through a symlink) is refused, whatever the rule does.
    with backup_round(recipe_dir, round_no) as round_backup:
        if round_backup.resumed:   # this round was cut short (a killed run, then --resume): undo it first
            undo_rounds(recipe_dir, round_no)
        try:
            note = rule.fix(failure, diagnosis.get("facts") or {}, context)
        except (WriteOutsideRecipe, WriteRefused):      # a write refused (a link out of the recipe): exit 2
            raise
        except Exception as exc:  # a fix that cannot apply is reported, the loop stops on repeat
            from agent.errors import filesystem_fault

            fault = filesystem_fault(exc, recipe_dir)   # EPERM / EROFS / EACCES / ENOSPC: the filesystem, exit 74
            if fault is not None:
                raise fault from None
            note = f"fix {rule.name} could not be applied: {exc.__class__.__name__}: {exc}"
    guard_refusal = round_backup.guard.refused     # refused even if the fix caught the exception
    if guard_refusal is not None:
        raise guard_refusal
    backup_dir = round_backup.dir
    # Whatever the fix wrote, the user's files keep their line endings, encoding, BOM and mode.
    if rule.keeps_format:
        restore_formats(recipe_dir, round_originals(recipe_dir, backup_dir))
        record_after(round_backup.recipe_dir, backup_dir)       # what the round left, formats restored
    diff = diff_against_backup(recipe_dir, backup_dir) + _copy_diff(recipe_dir, run_copy, copy_before)
    # A package installed is a change too, whether or not a file records it.
    applied = bool(diff) or (rule.installs and note.startswith("ran `"))
    return {"applied": applied, "rule": rule.name, "kind": rule.kind.value, "diff": diff, "note": note,
            "backup": str(backup_dir.relative_to(round_backup.recipe_dir)),
            "backup_bytes": round_backup.bytes_copied}


def _run_copy(recipe_dir: Path, yaml: Path | None) -> Path | None:
    """The YAML a fix edits when it is a run's copy in the recipe's state folder (a stand-in run's), else None."""
    from agent.recipe.targets import state_dir

    if yaml is None or not yaml.is_file() or yaml.is_symlink():
        return None
    try:
        yaml.resolve().relative_to(state_dir(Path(recipe_dir)).resolve())
    except ValueError:
        return None
    return yaml


def _copy_diff(recipe_dir: Path, copy: Path | None, before: bytes | None) -> str:
    import difflib

    if copy is None or before is None or not copy.is_file() or copy.read_bytes() == before:
        return ""
    rel = copy.resolve().relative_to(Path(recipe_dir).resolve()).as_posix()
    old = before.decode("utf-8", errors="replace").splitlines(keepends=True)
    new = copy.read_bytes().decode("utf-8", errors="replace").splitlines(keepends=True)
    return "".join(difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}"))
