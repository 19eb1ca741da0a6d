"""A repair rule is a row: name, evidence, diagnosis, fix.

The evidence is a pattern searched by `Failure.search` in the places the rule names (the error
line, the output, the rank logs, the traceback frames); `facts` turns the match (and the recipe)
into what the fix needs, or rejects it. A fix gets the full `Failure`, the facts and the workflow
options, and returns a one-line note; it knows nothing of the graph.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from agent.repair.failure import Failure
from engine import defaults


@dataclass
class RepairContext:
    """What a fix may use beyond the failure: workflow options."""
    allow_install: bool = False
    trust_remote_code: bool = False
    timeout_s: int = defaults.TIMEOUT_S
    notes: list[str] = field(default_factory=list)


def match_groups(failure: Failure, found: re.Match | None) -> dict:
    """Default facts: the pattern's named groups."""
    return {k: v for k, v in found.groupdict().items() if v is not None} if found else {}


def where_it_failed(failure: Failure) -> str:
    """The innermost recipe frame as `file:line: source`, else the innermost frame, else 'unknown'."""
    frames = failure.recipe_frames()
    if frames:
        rel, line = frames[-1]
        try:
            src = (failure.recipe_dir / rel).read_text(errors="replace").splitlines()[line - 1].strip()
        except (OSError, IndexError):
            src = ""
        return f"{rel}:{line}" + (f": {src}" if src else "")
    return failure.location or "unknown location"


def message_facts(failure: Failure, found: re.Match | None) -> dict:
    """Facts of a report-only rule: where it failed, the matched message and its named groups."""
    return {"where": where_it_failed(failure), "message": found.group(0)[:300] if found else "", **match_groups(failure, found)}


def report(note: str) -> Callable[[Failure, dict, RepairContext], str]:
    """A report-only fix: changes nothing, returns the diagnosis and next step."""
    def fix(failure: Failure, facts: dict, ctx: RepairContext) -> str:
        return note.format(**facts)
    return fix


class Kind(str, Enum):
    """What a rule's fix does (a str, so a round records it as its value)."""
    CODEMOD = "codemod"        # a codemod on the recipe's Python files
    YAML = "yaml"              # a line edit of the recipe YAML
    REMOVE = "remove"          # a file moved away or removed (backed up first)
    RERENDER = "rerender"      # a generated file rendered or vendored again
    INFER_SH = "infer.sh"      # an edit of a shell script
    REPORT = "report"          # nothing: a diagnosis and the next step
    LLM = "llm"                # a diff an LLM proposed


@dataclass(frozen=True)
class Rule:
    name: str
    evidence: re.Pattern | str | None                  # searched in `where`; None: `facts` decides alone
    diagnosis: str                                     # one line: what this failure is
    fix: Callable[[Failure, dict, RepairContext], str]  # applies the fix, returns a one-line note
    facts: Callable[[Failure, re.Match | None], dict | None] = message_facts  # None: not this rule after all
    where: tuple[str, ...] = ("error", "output")
    kind: Kind = Kind.REPORT
    keeps_format: bool = True                          # False: the fix is the format (e.g. CRLF -> LF)
    installs: bool = False                             # the fix may change the environment, not a file

    def __post_init__(self):
        object.__setattr__(self, "kind", Kind(self.kind))

    def match(self, failure: Failure) -> dict | None:
        """The facts for the fix when the evidence is there and the recipe agrees, else None."""
        found = None
        if self.evidence is not None:
            found = failure.search(self.evidence, self.where)
            if found is None:
                return None
        return self.facts(failure, found)
