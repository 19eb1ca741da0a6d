"""Rules about how the run ended: out of memory, past the timeout. Both only report: the graph
sends an out-of-memory diagnosis to the memory estimate, a timeout to the report."""

from __future__ import annotations

import re

from agent.repair.failure import Failure
from agent.repair.rules.rule import RepairContext, Rule

OOM_PATTERNS = re.compile(
    r"(MemoryError|out of memory|OutOfMemoryError|CUDA out of memory|NPU out of memory|"
    r"DefaultCPUAllocator: can't allocate memory|Cannot allocate memory(?! in static TLS)|std::bad_alloc)", re.I)
OUT_OF_MEMORY = "out_of_memory"


def _fix_oom(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    return f"the run ran out of memory ({facts['message']}): see the memory estimate"


def _timeout_facts(failure: Failure, found: re.Match | None) -> dict:
    lines = [ln.strip() for ln in failure.output.strip().splitlines() if ln.strip()]
    settings = failure.settings()
    data = settings.get("data_config") or {}
    return {"last_line": lines[-1][-300:] if lines else "(no output)",
            "max_new_tokens": data.get("max_new_tokens"), "world_size": settings.get("world_size")}


def _fix_timeout(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    # Report only: a hang has no safe automatic fix (the cause may be a collective, an input
    # wait or simply a slow device); the note says where it stopped and what to change.
    return (f"infer.sh ran past --timeout {ctx.timeout_s}s; its last output line was: {facts['last_line']!r}. "
            f"If it was still generating, raise --timeout or lower data_config.max_new_tokens "
            f"({facts['max_new_tokens']}); if it was waiting (world_size {facts['world_size']}: every rank "
            f"must start; or input/collective), fix that wait")


# Before every other rule.
FIRST: list[Rule] = [
    Rule(OUT_OF_MEMORY, OOM_PATTERNS, "out of memory", _fix_oom,
         facts=lambda failure, found: {"message": found.group(0)}, where=("output",), kind="report"),
]

RULES: list[Rule] = [
    Rule("run_timed_out", re.compile(r"^TimeoutError: infer\.sh did not finish"), "infer.sh hangs or runs past the timeout",
         _fix_timeout, facts=_timeout_facts, where=("error",), kind="report"),
]
