"""What a failed run left behind, as the repair rules see it, and the one evidence matcher.

A `Failure` carries the run's output (traceback + stdout/stderr, rank-log tracebacks included),
its rank logs, the traceback frames, the first real error line and where it was raised. Rules
never search text themselves: `Failure.search(pattern, where)` looks in the places a rule names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from agent.child_failure import is_progress, tracebacks
from agent.records import Run
from agent.recipe.recipe import NO_CODE_DIRS, Recipe, find_repo_root, read_settings

TRACEBACK_LOCATION_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')
ERROR_LINE_RE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Exit|Interrupt|Warning)\b.*|^\w+Error:.*")
RANK_PREFIX_RE = re.compile(r"^\[rank\d+\]: ?", re.M)
LIBRARY_PARTS = ("site-packages", "dist-packages")
TIMEOUT_ERROR = "TimeoutError: infer.sh did not finish within the timeout"


@dataclass
class Failure:
    """A failed run: the evidence every rule matches against and every fix may read."""
    recipe_dir: Path
    output: str                 # the run's output (evidence.txt: rank-log tracebacks appended)
    error: str                  # the first real exception line
    location: str | None        # innermost file:line (the recipe's own code first)
    timed_out: bool = False
    log: str = ""               # the rank logs (log_*.log), concatenated
    frames: list[tuple[str, int]] = field(default_factory=list)   # every `File "...", line N`, in order
    yaml: Path | None = None    # the YAML a fix edits: the run's (RunPlan.repaired_yaml; default: the recipe's)

    def __post_init__(self):
        if not self.frames:
            self.frames = [(file, int(line)) for file, line in TRACEBACK_LOCATION_RE.findall(self.output)]
        if self.timed_out and not self.error.startswith(TIMEOUT_ERROR[:37]):
            self.error = TIMEOUT_ERROR
        if self.yaml is None:
            self.yaml = self.recipe.yaml

    @cached_property
    def recipe(self) -> Recipe:
        return Recipe.at(self.recipe_dir)

    def settings(self) -> dict:
        """The run's YAML as data ({} when it is missing or broken)."""
        return read_settings(self.yaml)

    @classmethod
    def from_output(cls, recipe_dir: Path, output: str, timed_out: bool = False, log: str = "",
                    yaml: Path | None = None) -> Failure:
        root = Path(recipe_dir).resolve()
        # torch.distributed prefixes each line a rank prints with "[rankN]: ": the traceback is the same
        output, log = RANK_PREFIX_RE.sub("", output), RANK_PREFIX_RE.sub("", log)
        summary = summarise_failure(output, roots=[root, find_repo_root(root)])
        return cls(recipe_dir, output, summary["error"], summary["location"], timed_out, log, yaml=yaml)

    @classmethod
    def from_run(cls, recipe_dir: Path, run: Run) -> Failure:
        """The failure a trial run recorded (its evidence file, rank logs and YAML)."""
        output = Path(run["output_file"]).read_text(errors="replace") if run.get("output_file") else ""
        log_dir = Path(run["log_dir"]) if run.get("log_dir") else None
        log = "".join(p.read_text(errors="replace") for p in sorted(log_dir.glob("log_*.log"))) \
            if log_dir is not None and log_dir.is_dir() else ""
        # the recipe's YAML the run's copy was written from (a repair edits it), else the one it ran
        yaml = Path(run.get("repaired_yaml") or run["yaml"]) if run.get("yaml") else None
        failure = cls.from_output(recipe_dir, output, bool(run.get("timed_out")), log, yaml)
        if failure.timed_out:
            failure.error = f"{TIMEOUT_ERROR} ({run.get('summary')})"
        return failure

    def text(self, place: str) -> str:
        if place == "frames":
            return "\n".join(f"{file}:{line}" for file, line in self.frames)
        return getattr(self, place)

    def search(self, pattern: re.Pattern | str, where: tuple[str, ...] = ("error", "output")) -> re.Match | None:
        """The first match of `pattern` in the first place of `where` that has one."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        for place in where:
            found = regex.search(self.text(place))
            if found:
                return found
        return None

    def search_all(self, pattern: re.Pattern | str, where: tuple[str, ...] = ("output",)) -> list[re.Match]:
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        return [found for place in where for found in regex.finditer(self.text(place))]

    def recipe_frames(self) -> list[tuple[str, int]]:
        """(recipe-relative path, line) of the frames inside the recipe's own Python files, outermost first."""
        root = self.recipe_dir.resolve()
        frames = []
        for file, line in self.frames:
            try:
                rel = Path(file).resolve().relative_to(root)
            except (ValueError, OSError):
                continue
            if rel.suffix == ".py" and not set(rel.parts) & NO_CODE_DIRS and (root / rel).is_file():
                frames.append((str(rel), line))
        return frames


# ---- reading tracebacks ----------------------------------------------------------------------
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


def first_traceback(output: str) -> tuple[list[tuple[str, int]], str] | None:
    """(frames, exception line) of the first error in the output, or None.

    The first error is the real one: later tracebacks come from other ranks or from cleanup.
    A chain counts as one error: for `raise X from Y` the exception is X (the message written
    for the user), for an error raised while handling another it is the first; the frames are
    the whole chain's."""
    blocks = tracebacks(output)
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

    Without a traceback: the last exception-like line, else the last line that is no progress bar.
    Keys: error, location, traceback (bool)."""
    roots = [Path(r).resolve() for r in roots or [] if r is not None]
    found = first_traceback(output)
    if found is not None and found[1]:
        frames, error = found
        own = [f for f in frames if _inside(f[0], roots)] if roots else []
        user = [f for f in frames if not _is_library(f[0])]
        frame = (own or user or [None])[-1]
        where = f"{frame[0]}:{frame[1]}" if frame else None
        return {"error": error[:500], "location": where, "traceback": True}
    lines = [ln.rstrip() for ln in output.strip().splitlines() if ln.strip() and not is_progress(ln)]
    error = next((ln.strip() for ln in reversed(lines) if ERROR_LINE_RE.match(ln.strip())),
                 lines[-1].strip() if lines else "no output")
    locations = TRACEBACK_LOCATION_RE.findall(output)
    where = f"{locations[-1][0]}:{locations[-1][1]}" if locations else None
    return {"error": error[:500], "location": where, "traceback": False}


def signature(error: str) -> str:
    """Failure identity across rounds: the error line without addresses and numbers."""
    return re.sub(r"0x[0-9a-f]+|\d+(\.\d+)?", "#", error)[:300]
