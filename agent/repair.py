"""Diagnosis and repair of failing recipes.

A rule is data: a matcher on the failed run's output (traceback + log) and the recipe, a one-line
diagnosis, and a fix. Rules live in `agent/repair_rules/` (one module per kind of failure) and are
collected into CATALOGUE in order. Before a fix runs, every recipe source file is backed up under
`.migrator/backup/round_N/`; the round records the unified diff. `rollback` restores a backup.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from agent.errors import InputError
from engine import defaults

TRACEBACK_LOCATION_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')
ERROR_LINE_RE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Exit|Interrupt|Warning)\b.*|^\w+Error:.*")
OOM_PATTERNS = re.compile(
    r"(MemoryError|out of memory|OutOfMemoryError|CUDA out of memory|NPU out of memory|"
    r"DefaultCPUAllocator: can't allocate memory|Cannot allocate memory(?! in static TLS)|std::bad_alloc)", re.I)

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
    keeps_format: bool = True                          # False: the fix is the format (e.g. CRLF -> LF)


@dataclass
class RepairContext:
    """What a fix may use beyond the failure: workflow options."""
    allow_install: bool = False
    trust_remote_code: bool = False
    timeout_s: int = defaults.TIMEOUT_S
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
    from agent.repair_rules.field import explain_unknown

    known = explain_unknown(failure)
    closest = f" (closest known rule: {known['closest_rule']})" if known["closest_rule"] else ""
    return dict(base, rule=None, diagnosis=f"unknown failure: {failure.error}{closest}", **known)


def _jsonable(facts: dict) -> dict:
    return json.loads(json.dumps(facts, default=str))


# ---- backup, diff, rollback ------------------------------------------------------------
# .migrator/backup/round_N/          regular recipe files before round N's fix (written once, atomically)
# .migrator/backup/round_N.manifest.json   their paths;  round_N.run: the run that took it
# .migrator/backup/run               the current run (a fresh run starts a new one; --resume keeps it)
# .migrator/backup/earlier/<time>/   the rounds of earlier runs, kept
# .migrator/trash/<time>/            files a rollback replaced or that were created after the backup
ROUND_DIR_RE = re.compile(r"round_([0-9]{1,9})")


class UnsafeRecipePath(InputError):
    """A path in a recipe that the migrator refuses to write through (a symlink, a non-directory)."""


def _regular_files(root: Path, skip_dirs=frozenset()) -> dict[str, Path]:
    """Regular files under root by relative path; symlinks (to files or folders) are never followed."""
    files = {}
    if not root.is_dir() or root.is_symlink():
        return files
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs]
        base = Path(dirpath)
        for name in filenames:
            path = base / name
            rel = path.relative_to(root)
            if len(rel.parts) == 1 and name in skip_dirs:
                continue
            try:
                if stat.S_ISREG(os.lstat(path).st_mode):
                    files[rel.as_posix()] = path
            except OSError:
                continue
    return dict(sorted(files.items()))


def recipe_files(recipe_dir: Path) -> dict[str, Path]:
    return _regular_files(recipe_dir, SKIP_DIRS)


def real_dirs(root: Path, *parts: str, create: bool = True) -> Path:
    """root/parts..., each component a real directory (created if missing), never a symlink."""
    path = root
    for part in parts:
        path = path / part
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise UnsafeRecipePath(f"{path} is a symlink or not a directory; the migrator does not write "
                                   "through it: move it away")
        if create:
            path.mkdir(exist_ok=True)
    return path


def atomic_write(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write a temporary file beside `path` and rename it over: a symlink at `path` is replaced,
    never followed, and a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, stat.S_IMODE(mode))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _backups(recipe_dir: Path) -> Path:
    return real_dirs(recipe_dir, ".migrator", "backup")


def _current_run(backups: Path) -> str:
    marker = backups / "run"
    return marker.read_text(errors="replace").strip() if marker.is_file() and not marker.is_symlink() else ""


def start_backup_run(recipe_dir: Path, run_id: str) -> None:
    """A fresh run (not --resume): its round N backups are new; the earlier run's go to earlier/ when
    this run takes its own. Nothing to do (nothing written) when the recipe has no backups yet."""
    backups = recipe_dir / ".migrator" / "backup"
    if backups.is_dir() or backups.is_symlink():
        atomic_write(_backups(recipe_dir) / "run", (run_id + "\n").encode())


def _archive_rounds(backups: Path) -> None:
    entries = [p for p in backups.iterdir() if re.fullmatch(r"round_[0-9]+(\.manifest\.json|\.run)?", p.name)]
    if not entries:
        return
    dest = real_dirs(backups, "earlier") / time.strftime("%Y%m%dT%H%M%S")
    while dest.exists():
        dest = dest.with_name(dest.name + "_")
    dest.mkdir()
    for entry in entries:
        os.rename(entry, dest / entry.name)


def take_backup(recipe_dir: Path, round_no: int) -> tuple[Path, bool]:
    """Copy every regular recipe source file to .migrator/backup/round_N/ (with a manifest) once.
    The copy is made in a temporary folder renamed into place, so round_N exists only complete.
    Returns (backup dir, reused): a backup this run already took (a resumed run) is never retaken;
    one left by an earlier run is moved to earlier/ first."""
    backups = _backups(recipe_dir)
    dest = backups / f"round_{round_no}"
    run_id = _current_run(backups)
    stamp = backups / f"round_{round_no}.run"
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise UnsafeRecipePath(f"{dest} is a symlink or not a directory: move it away")
    if dest.is_dir():
        taken_by = stamp.read_text(errors="replace").strip() if stamp.is_file() and not stamp.is_symlink() else ""
        if taken_by == run_id and (backups / f"round_{round_no}.manifest.json").is_file():
            return dest, True
        _archive_rounds(backups)
    for stale in backups.glob(f".round_{round_no}.*"):      # a copy a killed run left unfinished
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale)
    tmp = Path(tempfile.mkdtemp(prefix=f".round_{round_no}.", dir=backups))
    files = recipe_files(recipe_dir)
    for rel, path in files.items():
        target = tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target, follow_symlinks=False)
    atomic_write(backups / f"round_{round_no}.manifest.json", json.dumps(sorted(files), indent=1).encode())
    atomic_write(stamp, (run_id + "\n").encode())
    os.chmod(tmp, 0o755)
    os.rename(tmp, dest)
    return dest, False


def backup(recipe_dir: Path, round_no: int) -> Path:
    return take_backup(recipe_dir, round_no)[0]


def diff_against_backup(recipe_dir: Path, backup_dir: Path) -> str:
    from agent.repair_rules._util import read_exact_lines

    before = set(_regular_files(backup_dir))
    after = set(recipe_files(recipe_dir))
    chunks = []
    for rel in sorted(before | after):
        old = read_exact_lines(backup_dir / rel) if rel in before else []   # true bytes: CRLF stays CRLF
        new = read_exact_lines(recipe_dir / rel) if rel in after else []
        if old != new:
            chunks.extend(difflib.unified_diff(old, new, f"a/{rel}" if old or rel in before else "/dev/null",
                                               f"b/{rel}" if rel in after else "/dev/null"))
    return "".join(chunks)


class BackupError(InputError):
    """A backup that cannot be restored safely (bad manifest, file missing or not regular)."""


def backup_rounds(recipe_dir: Path) -> list[int]:
    backups = recipe_dir / ".migrator" / "backup"
    if not backups.is_dir() or backups.is_symlink() or (recipe_dir / ".migrator").is_symlink():
        return []
    return sorted(int(m.group(1)) for p in backups.iterdir()
                  if (m := ROUND_DIR_RE.fullmatch(p.name)) and p.is_dir() and not p.is_symlink())


def _manifest(backups: Path, round_no: int) -> list[str]:
    path = backups / f"round_{round_no}.manifest.json"
    try:
        if path.is_symlink():
            raise ValueError("a symlink")
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BackupError(f"{path}: unreadable manifest ({exc.__class__.__name__})") from exc
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise BackupError(f"{path}: not a list of recipe paths")
    for rel in entries:
        parts = Path(rel).parts
        if (not rel or Path(rel).is_absolute() or ".." in parts or "\0" in rel or rel != Path(rel).as_posix()
                or parts[0] in SKIP_DIRS or set(parts[:-1]) & SKIP_DIRS):
            raise BackupError(f"{path}: entry {rel[:80]!r} is not a recipe file path")
    return sorted(set(entries))


class _Trash:
    """.migrator/trash/<time>/, made on first use: where rollback puts what it replaces."""

    def __init__(self, recipe_dir: Path):
        self.recipe_dir = recipe_dir
        self.dir: Path | None = None

    def put(self, rel: str) -> str:
        if self.dir is None:
            base = real_dirs(self.recipe_dir, ".migrator", "trash") / time.strftime("%Y%m%dT%H%M%S")
            while base.exists():
                base = base.with_name(base.name + "_")
            base.mkdir()
            self.dir = base
        dest = self.dir / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.recipe_dir / rel, dest)     # a symlink is moved itself, never followed
        return dest.relative_to(self.recipe_dir).as_posix()


def rollback(recipe_dir: Path, round_no: int | None = None) -> tuple[int, list[str]]:
    """Restore the recipe's regular files as they were before round N (default: the first round).
    Files created since and files replaced are moved to .migrator/trash/<time>/, never deleted;
    nothing is written through a symlink (one in the way is moved to the trash)."""
    recipe_dir = Path(recipe_dir)
    rounds = backup_rounds(recipe_dir)
    if not rounds:
        raise FileNotFoundError(f"{recipe_dir}: no repair backups under .migrator/backup/")
    round_no = rounds[0] if round_no is None else round_no
    if round_no not in rounds:
        raise FileNotFoundError(f"{recipe_dir}: no backup for round {round_no} (have {rounds})")
    backups = recipe_dir / ".migrator" / "backup"
    source = backups / f"round_{round_no}"
    manifest = _manifest(backups, round_no)
    saved = _regular_files(source)
    missing = [rel for rel in manifest if rel not in saved]
    if missing:
        raise BackupError(f"{source}: {missing[0]} is missing from the backup or not a regular file")
    trash = _Trash(recipe_dir)
    restored = []
    for rel in recipe_files(recipe_dir):
        if rel not in manifest:          # created by a later fix (or by hand): kept in the trash
            restored.append(f"moved {rel} to {trash.put(rel)}")
    for rel in manifest:
        data = saved[rel].read_bytes()
        mode = os.lstat(saved[rel]).st_mode
        parent = recipe_dir
        for part in Path(rel).parts[:-1]:
            parent = parent / part
            if parent.is_symlink() or (parent.exists() and not parent.is_dir()):
                moved = trash.put(parent.relative_to(recipe_dir).as_posix())
                restored.append(f"moved {parent.relative_to(recipe_dir).as_posix()} to {moved}")
            parent.mkdir(exist_ok=True)
        target = recipe_dir / rel
        if target.is_symlink() or (target.exists() and not target.is_file()):
            restored.append(f"moved {rel} to {trash.put(rel)}")
        elif target.exists():
            if target.read_bytes() == data and stat.S_IMODE(os.lstat(target).st_mode) == stat.S_IMODE(mode):
                continue
            trash.put(rel)
        atomic_write(target, data, mode)
        restored.append(f"restored {rel}")
    return round_no, restored


def repair(recipe_dir: Path, diagnosis: dict, round_no: int, context: RepairContext | None = None) -> dict:
    """Apply the matched rule's fix with a backup first; record the diff."""
    context = context or RepairContext()
    rule = rule_named(diagnosis.get("rule"))
    if rule is None:
        return {"applied": False, "diff": "", "note": "no repair rule matched"}
    from agent.repair_rules._util import restore_formats, snapshot_files

    backup_dir, resumed = take_backup(recipe_dir, round_no)
    if resumed:     # this round was cut short (a killed run, then --resume): start again from its backup
        rollback(recipe_dir, round_no)
    failure = Failure(recipe_dir, "", diagnosis.get("error", ""), diagnosis.get("location"))
    before = snapshot_files(recipe_files(recipe_dir))
    try:
        note = rule.fix(failure, diagnosis.get("facts") or {}, context)
    except Exception as exc:  # a fix that cannot apply is reported, the loop stops on repeat
        note = f"fix {rule.name} could not be applied: {exc.__class__.__name__}: {exc}"
    # Whatever the fix wrote, the user's files keep their line endings, encoding, BOM and mode.
    if rule.keeps_format:
        restore_formats(recipe_dir, before)
    diff = diff_against_backup(recipe_dir, backup_dir)
    return {"applied": bool(diff), "rule": rule.name, "kind": rule.kind, "diff": diff, "note": note,
            "backup": str(backup_dir.relative_to(recipe_dir))}
