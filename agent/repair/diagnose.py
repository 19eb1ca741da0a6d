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


# "ValueError" names no subsystem: a builtin exception's name relates no rule to a failure.
_BUILTIN_EXCEPTIONS = frozenset(n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException))
_TOKEN = re.compile(r"\w+")          # whole tokens: an identifier stays whole (attn_outputs is not "attn")
_EXCEPTION_NAME = re.compile(r"\w*(?:Error|Exception)$")
_ERROR_TYPE = re.compile(r"^\s*(?:[\w]+\.)*(\w+)(?::|$)")
# a part of evidence is distinctive when at most this many rules' patterns have it ("CUDA" is in three)
_DISTINCTIVE_DF = 2
_MAX_ALTERNATIVES = 64


def _identifier_like(token: str) -> bool:
    """HCCL, EI0006, flash_attn, HcclAllreduce, FlashAttention2: a name, not a plain word. Dunders
    (__init__), numbers and one or two letters name nothing of a subsystem."""
    core = token.strip("_")
    if token.startswith("__") and token.endswith("__") or len(core) < 3 or not any(c.isalpha() for c in core):
        return False            # a dunder, a number ("1", "98"), a letter or two ("_C")
    return "_" in core or any(c.isdigit() for c in core) or any(c.isupper() for c in core[1:])


def _alternatives(items) -> list[tuple[list[str], str]]:
    """Every alternative of a parsed regex sequence as (closed literal runs, the open run)."""
    from re import _constants as c

    alts: list[tuple[list[str], str]] = [([], "")]

    def close(group):
        return [(parts + ([run] if run else []), "") for parts, run in group]

    def product(group, subs):
        out = []
        for parts, run in group:
            for sub_parts, sub_run in subs:
                if sub_parts:       # the sub-sequence closed runs: ours joins its first, its last stays open
                    out.append((parts + [run + sub_parts[0], *sub_parts[1:]], sub_run))
                else:
                    out.append((parts, run + sub_run))
        return out[:_MAX_ALTERNATIVES]

    for op, arg in items:
        if op is c.LITERAL:
            alts = [(parts, run + chr(arg)) for parts, run in alts]
        elif op is c.SUBPATTERN:
            alts = product(alts, _alternatives(arg[3]))
        elif op is c.BRANCH:
            alts = product(alts, [alt for branch in arg[1] for alt in _alternatives(branch)])
        elif op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
            alts = close(alts)
            if arg[0] >= 1:           # an item that must be there: its literals are evidence, once
                alts = close(product(alts, _alternatives(arg[2])))
        elif op in (c.ASSERT, c.ASSERT_NOT, c.AT):
            continue                  # consumes nothing: neither evidence nor a break
        else:
            alts = close(alts)
    return alts


def evidence_branches(pattern: str) -> list[tuple[frozenset[str], frozenset[str]]]:
    """The alternatives of a rule's evidence pattern, each as (its whole literal tokens, lower-cased;
    the exception types it names). `No module named '(flash_attn[\\w.]*)'` has the tokens no, module,
    named, flash_attn and names no exception type."""
    from re import _parser

    branches = []
    for parts, run in _alternatives(_parser.parse(pattern)):
        tokens = [t for part in parts + [run] for t in _TOKEN.findall(part)]
        branches.append((frozenset(t.lower() for t in tokens), frozenset(t for t in tokens if _EXCEPTION_NAME.match(t))))
    return branches


def _evidence_text(rule) -> str:
    return rule.evidence.pattern if isinstance(rule.evidence, re.Pattern) else (rule.evidence or "")


def _token_rules() -> dict[str, int]:
    """How many catalogue rules' evidence has each token."""
    df: dict[str, int] = {}
    for rule in CATALOGUE:
        if rule.evidence is None:
            continue
        for token in set().union(*(tokens for tokens, _ in evidence_branches(_evidence_text(rule)))):
            df[token] = df.get(token, 0) + 1
    return df


def shared_evidence(rule, failure: Failure, df: dict[str, int]) -> tuple[int, set[str]] | None:
    """What of the rule's evidence the failure's error has: (2, {}) when its pattern matches the error
    itself (the rule's facts declined it), (1, the shared parts) when a branch of the pattern shares a
    distinctive whole identifier with the error (HCCL, flash_attn, HcclAllreduce; never a piece of one
    such as "attn" of attn_outputs) and the error is of the exception type that branch names, if any;
    None when nothing real is shared."""
    if rule.evidence is None:
        return None
    if failure.search(rule.evidence, ("error",)) is not None:
        return 2, set()
    raised = _ERROR_TYPE.match(failure.error)
    error_type = raised.group(1) if raised else None
    named = {t.lower(): t for t in _TOKEN.findall(failure.error) if t not in _BUILTIN_EXCEPTIONS}
    best: set[str] = set()
    for tokens, exceptions in evidence_branches(_evidence_text(rule)):
        if exceptions and error_type not in exceptions:
            continue              # this branch is about another exception
        shared = {named[t] for t in tokens & named.keys() if df.get(t, 0) <= _DISTINCTIVE_DF and _identifier_like(named[t])}
        if len(shared) > len(best):
            best = shared
    return (1, best) if best else None


def closest_rule(failure: Failure) -> tuple[str, float] | None:
    """The catalogue rule whose evidence the failure really shares (`shared_evidence`): its pattern
    found in the error, else the most distinctive identifiers in common; ties go to the rule whose
    name + diagnosis share the rarest words with the error. None when no rule shares evidence (a
    hint with nothing real in common with the failure misleads more than no hint)."""
    rules = [(rule, _words(f"{rule.name} {rule.diagnosis}")) for rule in CATALOGUE
             if rule.kind is not Kind.LLM and rule.name != OUT_OF_MEMORY]
    word_df: dict[str, int] = {}
    for _, words in rules:
        for w in words:
            word_df[w] = word_df.get(w, 0) + 1
    error = _words(failure.error)
    df = _token_rules()
    best = None
    for rule, words in rules:
        evidence = shared_evidence(rule, failure, df)
        if evidence is None:
            continue
        score = sum(math.log(len(rules) / word_df[w]) for w in error & words) / math.sqrt(len(words))
        key = (evidence[0], len(evidence[1]), score)
        if best is None or key > best[0]:
            best = (key, rule.name, round(score, 2))
    return (best[1], best[2]) if best else None


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
