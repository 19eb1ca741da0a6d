"""Diagnosis and repair of failing recipes.

A rule is a row (agent.repair_rules.rule.Rule): name, the evidence it matches in the failed run
(agent.failure.Failure: output, rank logs, traceback frames), a one-line diagnosis and a fix.
The rows live in `agent/repair_rules/` (one module per kind of failure), ordered in
agent.repair_rules.catalogue. Before a fix runs, every recipe source file is backed up
(agent.backup); the round records the unified diff.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from agent.backup import backup_round, diff_against_backup, rollback, round_originals
from agent.failure import Failure, signature
from agent.fs_guard import WriteOutsideRecipe
from agent.repair_rules._util import restore_formats
from agent.repair_rules.catalogue import CATALOGUE
from agent.repair_rules.rule import RepairContext, Rule
from agent.repair_rules.run import OUT_OF_MEMORY


def catalogue() -> list[Rule]:
    return CATALOGUE


def rule_named(name: str | None) -> Rule | None:
    return next((rule for rule in catalogue() if rule.name == name), None)


def first_matching_rule(failure: Failure) -> tuple[Rule, dict] | None:
    """The first catalogue rule that accepts the failure, with its facts (order = priority)."""
    for rule in catalogue():
        try:
            facts = rule.match(failure)
        except Exception:  # noqa: BLE001 - odd evidence (a broken YAML, a half-written file) is not this rule's
            continue
        if facts is not None:
            return rule, facts
    return None


def diagnose(recipe_dir: Path, run: dict, failure: Failure | None = None) -> dict:
    """The round's diagnosis of a failed run: the matched rule and its facts, or what is known of an
    unknown failure. `oom`: the out-of-memory rule matched (the graph goes to the memory estimate)."""
    failure = failure or Failure.from_run(recipe_dir, run)
    base = {"signature": signature(failure.error), "error": failure.error, "location": failure.location}
    matched = first_matching_rule(failure)
    if matched is not None:
        rule, facts = matched
        return dict(base, oom=rule.name == OUT_OF_MEMORY, rule=rule.name, facts=_jsonable(facts),
                    diagnosis=f"{rule.diagnosis}: {failure.error}")
    known = explain_unknown(failure)
    closest = f" (closest known rule: {known['closest_rule']})" if known["closest_rule"] else ""
    return dict(base, oom=False, rule=None, diagnosis=f"unknown failure: {failure.error}{closest}", **known)


def _jsonable(facts: dict) -> dict:
    return json.loads(json.dumps(facts, default=str))


# ---- unknown failures: still say what is known --------------------------------------------
_WORD = re.compile(r"[a-z][a-z0-9]+")
_NOISE = {"the", "a", "is", "of", "to", "in", "on", "or", "and", "not", "no", "error", "for", "this", "with", "an",
          "by", "at", "be", "has", "have", "file", "line", "recipe", "it", "its", "that", "than", "from"}


def _words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower().replace("_", " ")) if w not in _NOISE and len(w) > 2}


def closest_rule(failure: Failure) -> tuple[str, float] | None:
    """The catalogue rule whose name + diagnosis share the rarest words with the error (None: no word
    in common). Words are weighted by how few rules use them, so 'torch' counts for little, 'hccl' for much."""
    rules = [(rule.name, _words(f"{rule.name} {rule.diagnosis}")) for rule in catalogue()
             if rule.kind != "llm" and rule.name != OUT_OF_MEMORY]
    df: dict[str, int] = {}
    for _, words in rules:
        for w in words:
            df[w] = df.get(w, 0) + 1
    error = _words(failure.error)
    best = None
    for name, words in rules:
        shared = error & words
        if not shared:
            continue
        score = sum(math.log(len(rules) / df[w]) for w in shared) / math.sqrt(len(words))
        if best is None or score > best[1]:
            best = (name, round(score, 2))
    return best


def explain_unknown(failure: Failure, n_lines: int = 8) -> dict:
    """Exception, message, the last log lines before it and the closest known rule, for a failure no rule knows."""
    exception, _, message = failure.error.partition(":")
    if not message or " " in exception.strip():
        exception, message = "", failure.error
    lines = [ln.rstrip() for ln in failure.output.splitlines() if ln.strip()]
    cut = max((i for i, ln in enumerate(lines) if ln.strip() == failure.error.strip()), default=len(lines))
    before = [ln for ln in lines[:cut] if not ln.lstrip().startswith(("File \"", "Traceback", "^", "~"))]
    closest = closest_rule(failure)
    return {"exception": exception.strip(), "message": message.strip(), "last_lines": before[-n_lines:],
            "closest_rule": closest[0] if closest else None}


def repair(recipe_dir: Path, diagnosis: dict, round_no: int, context: RepairContext | None = None,
           failure: Failure | None = None, run: dict | None = None) -> dict:
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
    # Copy-on-write: each file is backed up just before the fix first changes it, and a write that
    # would land outside the recipe (through a symlink) is refused, whatever the rule does.
    with backup_round(recipe_dir, round_no) as round_backup:
        if round_backup.resumed:   # this round was cut short (a killed run, then --resume): undo it first
            rollback(recipe_dir, round_no)
        try:
            note = rule.fix(failure, diagnosis.get("facts") or {}, context)
        except WriteOutsideRecipe:
            raise
        except Exception as exc:  # a fix that cannot apply is reported, the loop stops on repeat
            note = f"fix {rule.name} could not be applied: {exc.__class__.__name__}: {exc}"
    guard_refusal = round_backup.guard.refused     # refused even if the fix caught the exception
    if guard_refusal is not None:
        raise guard_refusal
    backup_dir = round_backup.dir
    # Whatever the fix wrote, the user's files keep their line endings, encoding, BOM and mode.
    if rule.keeps_format:
        restore_formats(recipe_dir, round_originals(recipe_dir, backup_dir))
    diff = diff_against_backup(recipe_dir, backup_dir)
    return {"applied": bool(diff), "rule": rule.name, "kind": rule.kind, "diff": diff, "note": note,
            "backup": str(backup_dir.relative_to(round_backup.recipe_dir)),
            "backup_bytes": round_backup.bytes_copied}
