"""Repair: apply the matched rule's fix to the recipe, with a backup first, and record the diff.

Before a fix runs every recipe source file is backed up (agent.recipe.backup); whatever the fix
wrote, the user's files keep their line endings, encoding, BOM and mode (agent.recipe.textfile).
"""

from __future__ import annotations

from pathlib import Path

from agent.recipe.backup import diff_against_backup, recipe_files, rollback, take_backup
from agent.recipe.textfile import restore_formats, snapshot_files
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
    backup_dir, resumed = take_backup(recipe_dir, round_no)
    if resumed:     # this round was cut short (a killed run, then --resume): start again from its backup
        rollback(recipe_dir, round_no)
    if failure is None:
        failure = Failure.from_run(recipe_dir, run) if run else \
            Failure(recipe_dir, "", diagnosis.get("error", ""), diagnosis.get("location"))
    before = snapshot_files(recipe_files(recipe_dir))
    try:
        note = rule.fix(failure, diagnosis.get("facts") or {}, context)
    except Exception as exc:  # a fix that cannot apply is reported, the loop stops on repeat
        note = f"fix {rule.name} could not be applied: {exc.__class__.__name__}: {exc}"
    if rule.keeps_format:
        restore_formats(recipe_dir, before)
    diff = diff_against_backup(recipe_dir, backup_dir)
    # A package installed is a change too, whether or not a file records it.
    applied = bool(diff) or (rule.installs and note.startswith("ran `"))
    return {"applied": applied, "rule": rule.name, "kind": rule.kind.value, "diff": diff, "note": note,
            "backup": str(backup_dir.relative_to(recipe_dir))}
