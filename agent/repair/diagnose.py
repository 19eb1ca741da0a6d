"""Diagnosis of a failed run: the first catalogue rule whose evidence and facts accept it, or what
is known of a failure no rule knows.

A rule is a row (agent.repair.rules.rule.Rule): name, the evidence it matches in the failed run
(agent.repair.failure.Failure: output, rank logs, traceback frames), a one-line diagnosis and a fix.
The rows live in `agent/repair/rules/`, ordered in agent.repair.rules.catalogue; agent.repair.fix
applies the matched rule's fix.
"""

from __future__ import annotations

import builtins
import json
import math
import re
from pathlib import Path

from agent.records import Diagnosis, Run
from agent.repair.failure import Failure, signature
from agent.repair.rules.catalogue import CATALOGUE
from agent.repair.rules.rule import Kind, Rule
from agent.repair.rules.reports import OUT_OF_MEMORY
from engine.safe_load import loads_json


def rule_named(name: str | None) -> Rule | None:
    return next((rule for rule in CATALOGUE if rule.name == name), None)


def first_matching_rule(failure: Failure) -> tuple[Rule, dict] | None:
    """The first catalogue rule that accepts the failure, with its facts (order = priority)."""
    for rule in CATALOGUE:
        try:
            facts = rule.match(failure)
        except Exception:  # noqa: BLE001 - odd evidence (a broken YAML, a half-written file) is not this rule's
            continue
        if facts is not None:
            return rule, facts
    return None


def diagnose(recipe_dir: Path, run: Run, failure: Failure | None = None) -> Diagnosis:
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
    return loads_json(json.dumps(facts, default=str))


# ---- unknown failures: still say what is known --------------------------------------------
_WORD = re.compile(r"[a-z][a-z0-9]+")
_NOISE = {"the", "a", "is", "of", "to", "in", "on", "or", "and", "not", "no", "error", "for", "this", "with", "an",
          "by", "at", "be", "has", "have", "file", "line", "recipe", "it", "its", "that", "than", "from"}


def _words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower().replace("_", " ")) if w not in _NOISE and len(w) > 2}


# A word of an error written as an identifier (HCCL, SentencePiece, pad_token_id, EI0006, torch.npu):
# shared with a rule's evidence, one such word relates the two; plain words ("token ids") need two.
_IDENTIFIER = re.compile(r"\b(?:[A-Z]{3,}\w*|[A-Z][a-z]+[A-Z]\w*|\w+_\w+|\w*\d\w*|\w+(?:\.\w+)+)\b")

# "ValueError" names no subsystem: a builtin exception's name relates no rule to a failure.
_BUILTIN_EXCEPTIONS = frozenset(n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException))


def _evidence_text(rule) -> str:
    return rule.evidence.pattern if isinstance(rule.evidence, re.Pattern) else (rule.evidence or "")


def _related(rule, failure: Failure, error: set[str], identifiers: set[str]) -> bool:
    """The rule shares evidence with the failure: its pattern is found in the run (its facts
    declined), or the error names what the pattern looks for (one identifier-like word, or two words)."""
    if rule.evidence is not None and failure.search(rule.evidence, rule.where) is not None:
        return True
    if len(error & _words(_evidence_text(rule))) >= 2:
        return True
    return bool(identifiers & _words(f"{rule.name} {rule.diagnosis} {_evidence_text(rule)}"))


def closest_rule(failure: Failure) -> tuple[str, float] | None:
    """Among the catalogue rules that share evidence with the failure (`_related`), the one whose
    name + diagnosis share the rarest words with the error; None when no rule is related (a hint
    with nothing in common with the failure misleads more than no hint). Words are weighted by how
    few rules use them, so 'torch' counts for little, 'hccl' for much."""
    rules = [(rule, _words(f"{rule.name} {rule.diagnosis}")) for rule in CATALOGUE
             if rule.kind is not Kind.LLM and rule.name != OUT_OF_MEMORY]
    df: dict[str, int] = {}
    for _, words in rules:
        for w in words:
            df[w] = df.get(w, 0) + 1
    error = _words(failure.error)
    identifiers = set().union(*(_words(m.group(0)) for m in _IDENTIFIER.finditer(failure.error)
                                if m.group(0) not in _BUILTIN_EXCEPTIONS))
    best = None
    for rule, words in rules:
        if not _related(rule, failure, error, identifiers):
            continue
        shared = error & words
        if not shared and (rule.evidence is None or failure.search(rule.evidence, rule.where) is None):
            continue           # related by evidence words alone, nothing of what the rule is about
        score = sum(math.log(len(rules) / df[w]) for w in shared) / math.sqrt(len(words))
        if best is None or score > best[1]:
            best = (rule.name, round(score, 2))
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
