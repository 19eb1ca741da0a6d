"""Diagnosis and repair of failing recipes.

A rule is data: a matcher on the failed run's output (traceback + log) and the recipe, a one-line
diagnosis, and a fix. Rules live in `agent/repair_rules/` (one module per kind of failure) and are
collected into CATALOGUE in order. Before a fix runs, every recipe source file is backed up under
`.migrator/backup/round_N/`; the round records the unified diff. `rollback` restores a backup.
"""

from __future__ import annotations

import difflib
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

TRACEBACK_LOCATION_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')
ERROR_LINE_RE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Exit|Interrupt|Warning)\b.*|^\w+Error:.*")
OOM_PATTERNS = re.compile(
    r"(MemoryError|out of memory|OutOfMemoryError|CUDA out of memory|NPU out of memory|"
    r"DefaultCPUAllocator: can't allocate memory|Cannot allocate memory|std::bad_alloc)", re.I)

# Recipe files that are backed up before a fix (the run logs and backups themselves are not).
SKIP_DIRS = {".migrator", "res", "__pycache__", "baseline"}


@dataclass
class Failure:
    """What a failed run left behind, as the rules see it."""
    recipe_dir: Path
    output: str
    error: str                  # last exception line
    location: str | None        # innermost file:line
    timed_out: bool = False

    @classmethod
    def from_output(cls, recipe_dir: Path, output: str, timed_out: bool = False) -> "Failure":
        from agent.foreign import find_repo_root

        root = Path(recipe_dir).resolve()
        summary = summarise_failure(output, roots=[root, find_repo_root(root)])
        return cls(recipe_dir, output, summary["error"], summary["location"], timed_out)

    @property
    def model_name(self) -> str:
        runners = sorted(self.recipe_dir.glob("runner_*.py"))
        return runners[0].stem.removeprefix("runner_") if runners else self.recipe_dir.name


@dataclass
class Rule:
    name: str
    description: str                                   # one line: what this failure is
    match: Callable[[Failure], dict | None]            # -> facts for the fix, or None
    fix: Callable[[Failure, dict, "RepairContext"], str]   # applies the fix, returns a one-line note
    kind: str = "edit"                                 # codemod | yaml | remove | rerender | infer.sh | report


@dataclass
class RepairContext:
    """What a fix may use beyond the failure: workflow options."""
    allow_install: bool = False
    trust_remote_code: bool = False
    timeout_s: int = 1800
    notes: list[str] = field(default_factory=list)


TRACEBACK_START = "Traceback (most recent call last):"
CHAINED_RE = re.compile(r"^(During handling of the above exception|The above exception was the direct cause)")
LIBRARY_PARTS = ("site-packages", "dist-packages")
FRAME_RE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)')


def _is_library(file: str) -> bool:
    parts = Path(file).parts
    if any(p in LIBRARY_PARTS for p in parts) or file.startswith("<"):
        return True
    # the interpreter's own library: .../lib/python3.X/...
    return any(re.fullmatch(r"python\d+(\.\d+)?", p) for p in parts[:-1]) and "lib" in parts


def _inside(file: str, roots: list[Path]) -> bool:
    try:
        path = Path(file).resolve()
    except (OSError, RuntimeError):
        return False
    return any(root == path or root in path.parents for root in roots) and not _is_library(file)


def _tracebacks(output: str) -> list[tuple[list[tuple[str, int]], str, str | None]]:
    """Every traceback in the output: (frames, exception line, how it chains to the one before:
    "cause" for `raise ... from`, "context" for an error while handling, None for a new one)."""
    lines = output.splitlines()
    blocks = []
    link = None
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = CHAINED_RE.match(line.strip())
        if marker:
            link = "cause" if "direct cause" in line else "context"
            i += 1
            continue
        if TRACEBACK_START not in line:
            if line.strip() and not marker and link and not line.startswith((" ", "\t")):
                link = None     # something else came between: the next traceback is a new error
            i += 1
            continue
        frames: list[tuple[str, int]] = []
        error = ""
        j = i + 1
        while j < len(lines):
            rest = lines[j]
            m = FRAME_RE.match(rest)
            if m:
                frames.append((m.group("file"), int(m.group("line"))))
            elif rest.strip() and not rest.startswith((" ", "\t")):
                # strip a prefix some launchers put before the line ("[rank0]: ValueError: ...")
                error = re.sub(r"^\[rank\d+\]:\s*", "", rest.strip())
                break
            j += 1
        blocks.append((frames, error, link))
        link = None
        i = j + 1
    return blocks


def first_traceback(output: str) -> tuple[list[tuple[str, int]], str] | None:
    """(frames, exception line) of the first error in the output, or None.

    The first error is the real one: later tracebacks come from other ranks or from cleanup.
    A chain counts as one error: for `raise X from Y` the exception is X (the message written
    for the user), for an error raised while handling another it is the first; the frames are
    the whole chain's."""
    blocks = _tracebacks(output)
    if not blocks:
        return None
    group = [blocks[0]]
    for block in blocks[1:]:
        if block[2] is None:
            break
        group.append(block)
    error = group[0][1]
    for block in group[1:]:
        if block[2] == "cause":
            error = block[1]
        else:
            break
    frames = [frame for block in group for frame in block[0]]
    return frames, error


def summarise_failure(output: str, roots: list[Path | None] | None = None) -> dict:
    """The first real error: its exception line and the innermost frame inside `roots` (the recipe and
    the repository it belongs to), else the innermost frame outside library internals.

    Without a traceback: the last exception-like line. Keys: error, location, traceback (bool)."""
    roots = [Path(r).resolve() for r in roots or [] if r is not None]
    found = first_traceback(output)
    if found is not None and found[1]:
        frames, error = found
        own = [f for f in frames if _inside(f[0], roots)] if roots else []
        user = [f for f in frames if not _is_library(f[0])]
        frame = (own or user or [None])[-1]
        where = f"{frame[0]}:{frame[1]}" if frame else None
        return {"error": error[:500], "location": where, "traceback": True}
    lines = [ln.rstrip() for ln in output.strip().splitlines() if ln.strip()]
    error = next((ln.strip() for ln in reversed(lines) if ERROR_LINE_RE.match(ln.strip())),
                 lines[-1].strip() if lines else "no output")
    locations = TRACEBACK_LOCATION_RE.findall(output)
    where = f"{locations[-1][0]}:{locations[-1][1]}" if locations else None
    return {"error": error[:500], "location": where, "traceback": False}


def signature(error: str) -> str:
    """Failure identity across rounds: the error line without addresses and numbers."""
    return re.sub(r"0x[0-9a-f]+|\d+(\.\d+)?", "#", error)[:300]


def is_oom(output: str) -> bool:
    return bool(OOM_PATTERNS.search(output))


def load_failure(recipe_dir: Path, run: dict) -> Failure:
    output = Path(run["output_file"]).read_text(errors="replace") if run.get("output_file") else ""
    failure = Failure.from_output(recipe_dir, output, bool(run.get("timed_out")))
    if failure.timed_out:
        failure.error = f"TimeoutError: infer.sh did not finish within the timeout ({run.get('summary')})"
    return failure


def catalogue() -> list[Rule]:
    from agent.repair_rules import CATALOGUE

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


def diagnose(recipe_dir: Path, run: dict) -> dict:
    failure = load_failure(recipe_dir, run)
    base = {"signature": signature(failure.error), "error": failure.error, "location": failure.location,
            "oom": is_oom(failure.output)}
    if base["oom"]:
        return dict(base, rule=None, diagnosis=f"out of memory: {failure.error}")
    matched = first_matching_rule(failure)
    if matched is not None:
        rule, facts = matched
        return dict(base, rule=rule.name, facts=_jsonable(facts), diagnosis=f"{rule.description}: {failure.error}")
    return dict(base, rule=None, diagnosis=f"unknown failure: {failure.error}")


def _jsonable(facts: dict) -> dict:
    return json.loads(json.dumps(facts, default=str))


# ---- backup, diff, rollback ------------------------------------------------------------
def recipe_files(recipe_dir: Path) -> dict[str, Path]:
    files = {}
    for path in sorted(recipe_dir.rglob("*")):
        rel = path.relative_to(recipe_dir)
        if path.is_file() and not (set(rel.parts[:-1]) & SKIP_DIRS) and rel.parts[0] not in SKIP_DIRS:
            files[str(rel)] = path
    return files


def backup(recipe_dir: Path, round_no: int) -> Path:
    """Copy every recipe source file to .migrator/backup/round_N/ (with a manifest)."""
    dest = recipe_dir / ".migrator" / "backup" / f"round_{round_no}"
    if dest.exists():
        shutil.rmtree(dest)
    files = recipe_files(recipe_dir)
    for rel, path in files.items():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    (dest.parent / f"round_{round_no}.manifest.json").write_text(json.dumps(sorted(files), indent=1))
    return dest


def diff_against_backup(recipe_dir: Path, backup_dir: Path) -> str:
    from agent.repair_rules._util import read_exact_lines

    before = {str(p.relative_to(backup_dir)) for p in backup_dir.rglob("*") if p.is_file()}
    after = set(recipe_files(recipe_dir))
    chunks = []
    for rel in sorted(before | after):
        old = read_exact_lines(backup_dir / rel) if rel in before else []   # true bytes: CRLF stays CRLF
        new = read_exact_lines(recipe_dir / rel) if rel in after else []
        if old != new:
            chunks.extend(difflib.unified_diff(old, new, f"a/{rel}" if old or rel in before else "/dev/null",
                                               f"b/{rel}" if rel in after else "/dev/null"))
    return "".join(chunks)


def rollback(recipe_dir: Path, round_no: int | None = None) -> tuple[int, list[str]]:
    """Restore the recipe as it was before round N (default: before the first round)."""
    backups = recipe_dir / ".migrator" / "backup"
    rounds = sorted(int(p.name.split("_")[1]) for p in backups.glob("round_*") if p.is_dir())
    if not rounds:
        raise FileNotFoundError(f"{recipe_dir}: no repair backups under .migrator/backup/")
    round_no = rounds[0] if round_no is None else round_no
    if round_no not in rounds:
        raise FileNotFoundError(f"{recipe_dir}: no backup for round {round_no} (have {rounds})")
    source = backups / f"round_{round_no}"
    manifest = set(json.loads((backups / f"round_{round_no}.manifest.json").read_text()))
    restored = []
    for rel, path in recipe_files(recipe_dir).items():
        if rel not in manifest:          # created by a later fix
            path.unlink()
            restored.append(f"removed {rel}")
    for rel in sorted(manifest):
        target = recipe_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists() or target.read_bytes() != (source / rel).read_bytes():
            shutil.copy2(source / rel, target)
            restored.append(f"restored {rel}")
    return round_no, restored


def repair(recipe_dir: Path, diagnosis: dict, round_no: int, context: RepairContext | None = None) -> dict:
    """Apply the matched rule's fix with a backup first; record the diff."""
    context = context or RepairContext()
    rule = rule_named(diagnosis.get("rule"))
    if rule is None:
        return {"applied": False, "diff": "", "note": "no repair rule matched"}
    from agent.repair_rules._util import restore_formats, snapshot_files

    backup_dir = backup(recipe_dir, round_no)
    failure = Failure(recipe_dir, "", diagnosis.get("error", ""), diagnosis.get("location"))
    before = snapshot_files(recipe_files(recipe_dir))
    try:
        note = rule.fix(failure, diagnosis.get("facts") or {}, context)
    except Exception as exc:  # a fix that cannot apply is reported, the loop stops on repeat
        note = f"fix {rule.name} could not be applied: {exc.__class__.__name__}: {exc}"
    # Whatever the fix wrote, the user's files keep their line endings, encoding, BOM and mode.
    restore_formats(recipe_dir, before)
    diff = diff_against_backup(recipe_dir, backup_dir)
    return {"applied": bool(diff), "rule": rule.name, "kind": rule.kind, "diff": diff, "note": note,
            "backup": str(backup_dir.relative_to(recipe_dir))}
