"""Diagnosis and repair of failing recipes (catalogue grows in issue [4/5]).

`diagnose` turns a failed run into a signature + one-line diagnosis; `repair` applies the rule's
fix and records what changed. With no matching rule the round records the failure and no patch.
"""

from __future__ import annotations

import re
from pathlib import Path

TRACEBACK_LOCATION_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def summarise_failure(output: str) -> dict:
    """Last exception line and the innermost file:line of the traceback."""
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    error = next((ln.strip() for ln in reversed(lines) if re.match(r"^\w[\w.]*(Error|Exception|Exit)\b", ln.strip())),
                 lines[-1].strip() if lines else "no output")
    locations = TRACEBACK_LOCATION_RE.findall(output)
    where = f"{locations[-1][0]}:{locations[-1][1]}" if locations else None
    return {"error": error[:500], "location": where}


def diagnose(recipe_dir: Path, run: dict) -> dict:
    output = Path(run["output_file"]).read_text(errors="replace") if run.get("output_file") else ""
    summary = summarise_failure(output)
    if run.get("timed_out"):
        summary["error"] = f"run timed out ({run.get('summary')})"
    return {"rule": None, "signature": summary["error"], "diagnosis": f"unknown failure: {summary['error']}",
            "location": summary["location"], "oom": is_oom(output)}


OOM_PATTERNS = re.compile(
    r"(MemoryError|out of memory|OutOfMemoryError|CUDA out of memory|NPU out of memory|"
    r"DefaultCPUAllocator: can't allocate memory|Cannot allocate memory|std::bad_alloc)", re.I)


def is_oom(output: str) -> bool:
    return bool(OOM_PATTERNS.search(output))


def repair(recipe_dir: Path, diagnosis: dict, round_no: int) -> dict:
    """No rule known yet for this failure: record it, change nothing."""
    return {"applied": False, "diff": "", "note": "no repair rule matched"}
