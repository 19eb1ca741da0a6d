"""Repair backups: every recipe source file is copied under `.migrator/backup/round_N/` before a
fix runs; the round records the unified diff; `rollback` restores a backup. Nothing is ever
written through a symlink, and files are replaced atomically.

Rollback loses nothing: it undoes only the rounds of the latest run (the run that made them is the
last one; a run that repaired nothing leaves nothing to undo), each once (an undone round moves to
rolled_back/), and only over files still as those rounds left them (one changed since, by hand or
otherwise, is named and nothing is rolled back unless forced). Anything else is refused in one line."""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import stat
import time
from pathlib import Path

from agent.errors import InputError
from agent.recipe.fs_guard import WriteGuard, user_tree

from agent.recipe.recipe import NO_CODE_DIRS
from agent.recipe.targets import state_dir, state_parts
from agent.recipe.textfile import read_exact_lines
from engine.safe_load import load_json, loads_json

# Recipe files that are backed up before a fix: all but the run state, logs and baselines.
SKIP_DIRS = NO_CODE_DIRS


# ---- backup, diff, rollback ------------------------------------------------------------
# .migrator/backup/round_N/          regular recipe files before round N's fix (written once, atomically)
# .migrator/backup/round_N.manifest.json   their paths;  round_N.run: the run that took it
# .migrator/backup/round_N.after.json      the state the round left each path it changed in
# .migrator/backup/run               the current run (a fresh run starts a new one; --resume keeps it)
# .migrator/backup/earlier/<time>/   the rounds of earlier runs, kept
# .migrator/backup/rolled_back/<time>/   rounds a rollback undid, kept (never undone twice)
# .migrator/trash/<time>/            files a rollback replaced or that were created after the backup
ROUND_DIR_RE = re.compile(r"round_([0-9]{1,9})")
ROUND_FILES_RE = re.compile(r"round_[0-9]+(\.manifest\.json|\.journal|\.run|\.after\.json)?")
# what a path was left as: absent, a folder, a link to its target, a regular file of its mode and content
STATE_RE = re.compile(r"absent|dir|link:.+|file:[0-7]{1,4}:[0-9a-f]{64}", re.S)
PERMISSION_BITS = 0o777          # the only mode bits a backup records or a rollback restores
JOURNAL_MAX_BYTES = 64 * 2**20
JOURNAL_MAX_ENTRIES = 100_000
MAX_REL_PATH = 4096


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
            user_tree(root).mkdir(path, parents=False)
    return path


def atomic_write(path: Path, data: bytes, mode: int | None = None, *, root: Path, what: str = "the recipe") -> None:
    """engine.safe_write's write-and-rename of `path` in the tree `root` (the recipe, the store it lies
    in): a reader never sees half a file, a hard-linked file is replaced (its other names keep their
    bytes), a symlink out of `root` anywhere on the way is refused, and the mode (default: the umask's)
    is permission bits only (never setuid / setgid / sticky)."""
    user_tree(root, what).write_bytes(path, data, mode, keep_mode=False)


def _backups(recipe_dir: Path) -> Path:
    return real_dirs(recipe_dir, *state_parts(recipe_dir), "backup")


def _current_run(backups: Path) -> str:
    marker = backups / "run"
    return marker.read_text(errors="replace").strip() if marker.is_file() and not marker.is_symlink() else ""


def start_backup_run(recipe_dir: Path, run_id: str) -> None:
    """A fresh run (not --resume): its round N backups are new; the earlier run's go to earlier/ when
    this run takes its own. Nothing to do (nothing written) when the recipe has no backups yet."""
    backups = state_dir(recipe_dir) / "backup"
    if backups.is_dir() or backups.is_symlink():
        atomic_write(_backups(recipe_dir) / "run", (run_id + "\n").encode(), root=recipe_dir)


def _archive_rounds(recipe_dir: Path, backups: Path, into: str = "earlier", rounds=None) -> None:
    """Move rounds (default: all) out of the way into backup/<into>/<time>/, kept."""
    entries = [p for p in backups.iterdir() if ROUND_FILES_RE.fullmatch(p.name)
               and (rounds is None or int(re.match(r"round_([0-9]+)", p.name).group(1)) in rounds)]
    if not entries:
        return
    dest = real_dirs(recipe_dir, *state_parts(recipe_dir), "backup", into) / time.strftime("%Y%m%dT%H%M%S")
    while dest.exists():
        dest = dest.with_name(dest.name + "_")
    backups_tree = user_tree(recipe_dir)
    backups_tree.mkdir(dest, exist_ok=False)
    for entry in entries:
        backups_tree.replace(entry, dest / entry.name)


def _open_round(recipe_dir: Path, round_no: int) -> tuple[Path, bool]:
    """.migrator/backup/round_N/ for this run, and whether this run had already opened it (a
    resumed round). A round left by an earlier run is moved to earlier/ first."""
    backups = _backups(recipe_dir)
    dest = backups / f"round_{round_no}"
    run_id = _current_run(backups)
    stamp = backups / f"round_{round_no}.run"
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise UnsafeRecipePath(f"{dest} is a symlink or not a directory: move it away")
    if dest.is_dir():
        taken_by = stamp.read_text(errors="replace").strip() if stamp.is_file() and not stamp.is_symlink() else ""
        if taken_by == run_id and ((backups / f"round_{round_no}.journal").is_file()
                                   or (backups / f"round_{round_no}.manifest.json").is_file()):
            return dest, True
        _archive_rounds(recipe_dir, backups)
    backups_tree = user_tree(recipe_dir)
    for stale in backups.glob(f".round_{round_no}.*"):      # a copy a killed run left unfinished
        if stale.is_dir() and not stale.is_symlink():
            backups_tree.rmtree(stale)
    tmp = backups / f".round_{round_no}.{os.urandom(6).hex()}"
    backups_tree.mkdir(tmp, exist_ok=False)
    backups_tree.unlink(backups / f"round_{round_no}.journal")
    atomic_write(backups / f"round_{round_no}.journal", b"", root=recipe_dir)
    atomic_write(stamp, (run_id + "\n").encode(), root=recipe_dir)
    backups_tree.chmod(tmp, 0o755)
    backups_tree.replace(tmp, dest)
    return dest, False


def take_backup(recipe_dir: Path, round_no: int) -> tuple[Path, bool]:
    """Open round N's copy-on-write backup (see RoundBackup): files are copied into it only as a
    fix is about to change them. Returns (backup dir, reused): a round this run already opened (a
    resumed run) is reused, never retaken."""
    return _open_round(recipe_dir, round_no)


def backup(recipe_dir: Path, round_no: int) -> Path:
    return take_backup(recipe_dir, round_no)[0]


class RoundBackup:
    """Copy-on-write backup of one repair round: `save(rel)` copies a recipe path the first time
    it is about to change (a file's bytes and mode, a symlink's target, a folder's contents, or
    that it did not exist) and appends it to round_N.journal, durably, before the change happens.
    The round's backup is what the round changed, however large the recipe."""

    def __init__(self, recipe_dir: Path, round_no: int):
        self.recipe_dir = Path(recipe_dir).resolve()
        self.dir, self.resumed = _open_round(self.recipe_dir, round_no)
        self.round_no = round_no
        self.journal = self.dir.parent / f"round_{round_no}.journal"
        self.entries = {e["path"]: e for e in read_journal(self.journal)} if self.journal.is_file() else {}
        self.bytes_copied = 0

    def _append(self, entry: dict) -> None:
        self.entries[entry["path"]] = entry
        user_tree(self.recipe_dir).append_bytes(
            self.journal, (json.dumps(entry, sort_keys=True) + "\n").encode(), sync=True)

    def save(self, rel: str, what: str = "write") -> None:
        if rel in self.entries or rel == "." or rel.split("/")[0] in SKIP_DIRS:
            return
        path = self.recipe_dir / rel
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            self._append({"path": rel, "was": "absent"})
            return
        if stat.S_ISLNK(st.st_mode):
            self._append({"path": rel, "was": "link", "target": os.readlink(path)})
        elif stat.S_ISREG(st.st_mode):
            dest = self.dir / rel
            real_dirs(self.recipe_dir, *self.dir.relative_to(self.recipe_dir).parts, *Path(rel).parts[:-1])
            user_tree(self.recipe_dir).copy(path, dest)
            self.bytes_copied += st.st_size
            self._append({"path": rel, "was": "file", "mode": stat.S_IMODE(st.st_mode) & PERMISSION_BITS})
        elif stat.S_ISDIR(st.st_mode):
            self._append({"path": rel, "was": "dir"})
            if what in ("rmtree", "rename"):           # its contents go with it: save them too
                for entry in sorted(os.listdir(path)):
                    self.save(f"{rel}/{entry}", what)

    def changed(self) -> list[str]:
        return sorted(self.entries)


def backup_round(recipe_dir: Path, round_no: int):
    """Context manager for a repair round: every write into the recipe while it is open is checked
    (nothing written outside the recipe through a symlink) and backed up before it happens."""
    import contextlib

    @contextlib.contextmanager
    def guarded():
        round_backup = RoundBackup(recipe_dir, round_no)
        try:
            with WriteGuard(round_backup.recipe_dir, on_change=round_backup.save,
                            exempt=frozenset(SKIP_DIRS)) as round_backup.guard:
                yield round_backup
        finally:
            record_after(round_backup.recipe_dir, round_backup.dir)
    return guarded()


def _path_state(path: Path) -> str:
    """What `path` is now, as round_N.after.json records it (STATE_RE)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "absent"
    if stat.S_ISLNK(info.st_mode):
        return "link:" + os.readlink(path)
    if stat.S_ISDIR(info.st_mode):
        return "dir"
    if stat.S_ISREG(info.st_mode):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(2**20), b""):
                digest.update(chunk)
        return f"file:{stat.S_IMODE(info.st_mode) & PERMISSION_BITS:o}:{digest.hexdigest()}"
    return "other"


def record_after(recipe_dir: Path, backup_dir: Path) -> None:
    """round_N.after.json: the state the round left each path its journal lists in (what a rollback checks
    is still there before it overwrites anything). Written again when the round's files change after its
    guard closed (agent.repair.fix restores their formats)."""
    journal = backup_dir.parent / f"{backup_dir.name}.journal"
    if not journal.is_file():
        return
    states = {e["path"]: _path_state(Path(recipe_dir) / e["path"]) for e in read_journal(journal)}
    atomic_write(backup_dir.parent / f"{backup_dir.name}.after.json", json.dumps(states, sort_keys=True).encode(),
                 root=Path(recipe_dir))


def _read_after(backups: Path, round_no: int) -> dict[str, str] | None:
    """round_N.after.json, allow-listed like the journal (None: the round has none, e.g. of an earlier release
    or cut short by a kill)."""
    path = backups / f"round_{round_no}.after.json"
    if not os.path.lexists(path):
        return None
    try:
        if path.is_symlink():
            raise ValueError("a symlink")
        states = load_json(path, max_bytes=JOURNAL_MAX_BYTES)
    except (OSError, ValueError) as exc:
        raise BackupError(f"{path}: unreadable ({exc.__class__.__name__}); not a record this tool wrote") from None
    if not isinstance(states, dict) or not all(isinstance(v, str) and STATE_RE.fullmatch(v) for v in states.values()):
        raise BackupError(f"{path}: not a record of path states this tool wrote")
    for rel in states:
        _check_rel(path, rel)
    return states


JOURNAL_KINDS = {"file": {"path", "was", "mode"}, "absent": {"path", "was"}, "link": {"path", "was", "target"},
                 "dir": {"path", "was"}}


def read_journal(path: Path) -> list[dict]:
    """round_N.journal, read with an allow-list (a received recipe's journal is untrusted input): each line
    one JSON object of a known kind with a recipe-relative path, a mode of permission bits only (0..0o777:
    never setuid, setgid or sticky), a link target that stays inside the recipe; size and entry count capped.
    A torn last line (a run killed while appending) is ignored."""
    from engine.safe_load import LoadError, read_capped

    if path.is_symlink():
        raise BackupError(f"{path}: a symlink; the migrator does not read backups through links")
    try:
        lines = read_capped(path, JOURNAL_MAX_BYTES).split(b"\n")
    except LoadError as exc:
        raise BackupError(f"{path}: not a journal ({exc.problem})") from None
    except OSError as exc:
        raise BackupError(f"{path}: unreadable journal ({exc.__class__.__name__})") from exc
    entries = []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        if len(entries) >= JOURNAL_MAX_ENTRIES:
            raise BackupError(f"{path}: more than {JOURNAL_MAX_ENTRIES} entries; not a journal this tool wrote")
        try:
            entry = loads_json(raw, f"{path}:{i + 1}", max_depth=2)
        except ValueError:
            if i == len(lines) - 1 or all(not rest.strip() for rest in lines[i + 1:]):
                break           # the torn last line of a killed run
            raise BackupError(f"{path}: line {i + 1} is not JSON") from None
        kind = entry.get("was") if isinstance(entry, dict) else None
        if kind not in JOURNAL_KINDS or set(entry) != JOURNAL_KINDS[kind]:
            raise BackupError(f"{path}: line {i + 1} is not a backup entry")
        _check_rel(path, entry["path"])
        if "mode" in entry:
            mode = entry["mode"]
            if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= PERMISSION_BITS:
                shown = oct(mode) if isinstance(mode, int) and not isinstance(mode, bool) else repr(mode)[:40]
                raise BackupError(f"{path}: line {i + 1}: mode {shown} of {entry['path']!r} is not permission bits "
                                  "(0..0o777); setuid, setgid and sticky modes are never restored")
        if "target" in entry:
            _check_link_target(path, i + 1, entry["path"], entry["target"])
        entries.append(entry)
    return entries


def _check_link_target(where: Path, line: int, rel: str, target) -> None:
    """A journal's link target: text, relative, resolving (lexically) inside the recipe."""
    if not isinstance(target, str) or not target or "\0" in target or len(target) > MAX_REL_PATH \
            or re.search(r"[\x00-\x1f]", target):
        raise BackupError(f"{where}: line {line}: link {rel!r} has no usable target")
    joined = os.path.normpath(os.path.join(os.path.dirname(rel), target))
    if os.path.isabs(target) or joined == ".." or joined.startswith("../") or os.path.isabs(joined):
        raise BackupError(f"{where}: line {line}: link {rel!r} -> {target[:80]!r} points outside the recipe; "
                          "a rollback restores links inside the recipe only")


def _check_rel(where: Path, rel) -> None:
    parts = Path(rel).parts if isinstance(rel, str) else ()
    if (not isinstance(rel, str) or not parts or len(rel) > MAX_REL_PATH or re.search(r"[\x00-\x1f\\]", rel)
            or Path(rel).is_absolute() or ".." in parts or rel != Path(rel).as_posix()
            or parts[0] in SKIP_DIRS or set(parts[:-1]) & SKIP_DIRS):
        raise BackupError(f"{where}: entry {str(rel)[:80]!r} is not a recipe file path")


def round_originals(recipe_dir: Path, backup_dir: Path) -> dict[str, tuple[bytes, int]]:
    """(original bytes, mode) of the regular files a copy-on-write round changed."""
    journal = backup_dir.parent / f"{backup_dir.name}.journal"
    originals = {}
    for entry in read_journal(journal) if journal.is_file() else []:
        if entry["was"] == "file" and (backup_dir / entry["path"]).is_file():
            originals[entry["path"]] = ((backup_dir / entry["path"]).read_bytes(), entry["mode"])
    return originals


def diff_against_backup(recipe_dir: Path, backup_dir: Path) -> str:
    """The round's unified diff: over what its journal lists (copy-on-write), else, for a full
    backup of an earlier release, over every recipe file."""
    journal = backup_dir.parent / f"{backup_dir.name}.journal"
    if journal.is_file():
        before, after = set(), set()
        for entry in read_journal(journal):
            rel = entry["path"]
            if entry["was"] == "file":
                before.add(rel)
            if entry["was"] in ("file", "absent") and (recipe_dir / rel).is_file() \
                    and not (recipe_dir / rel).is_symlink():
                after.add(rel)
        return _diff(recipe_dir, backup_dir, before, after)
    return _diff(recipe_dir, backup_dir, set(_regular_files(backup_dir)), set(recipe_files(recipe_dir)))


def _diff(recipe_dir: Path, backup_dir: Path, before: set[str], after: set[str]) -> str:
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
    backups = state_dir(recipe_dir) / "backup"
    if not backups.is_dir() or backups.is_symlink() or state_dir(recipe_dir).is_symlink():
        return []
    return sorted(int(m.group(1)) for p in backups.iterdir()
                  if (m := ROUND_DIR_RE.fullmatch(p.name)) and p.is_dir() and not p.is_symlink())


def _manifest(backups: Path, round_no: int) -> list[str]:
    path = backups / f"round_{round_no}.manifest.json"
    try:
        if path.is_symlink():
            raise ValueError("a symlink")
        entries = load_json(path, max_bytes=JOURNAL_MAX_BYTES)
    except (OSError, ValueError) as exc:
        raise BackupError(f"{path}: unreadable manifest ({exc.__class__.__name__})") from exc
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise BackupError(f"{path}: not a list of recipe paths")
    for rel in entries:
        _check_rel(path, rel)
    return sorted(set(entries))


class _Trash:
    """.migrator/trash/<time>/, made on first use: where rollback puts what it replaces."""

    def __init__(self, recipe_dir: Path):
        self.recipe_dir = recipe_dir
        self.dir: Path | None = None

    def put(self, rel: str) -> str:
        if self.dir is None:
            base = real_dirs(self.recipe_dir, *state_parts(self.recipe_dir), "trash") / time.strftime("%Y%m%dT%H%M%S")
            while base.exists():
                base = base.with_name(base.name + "_")
            _rollback_tree(self.recipe_dir).mkdir(base, exist_ok=False)
            self.dir = base
        dest = self.dir / rel
        # a symlink is moved itself, never followed (one out of the recipe too: rollback's tree keeps no links)
        _rollback_tree(self.recipe_dir).replace(self.recipe_dir / rel, dest)
        return dest.relative_to(self.recipe_dir).as_posix()


def _stamp(backups: Path, round_no: int) -> str:
    stamp = backups / f"round_{round_no}.run"
    return stamp.read_text(errors="replace").strip() if stamp.is_file() and not stamp.is_symlink() else ""


def latest_run_rounds(recipe_dir: Path) -> list[int]:
    """The rounds a rollback may undo: those of the latest run, not undone yet (a run that repaired nothing
    has none, whatever earlier runs left)."""
    rounds = backup_rounds(recipe_dir)
    if not rounds:
        return []
    backups = state_dir(recipe_dir) / "backup"
    run_id = _current_run(backups)
    return [r for r in rounds if _stamp(backups, r) == run_id]


def _touched(backups: Path, rounds: list[int]) -> list[str]:
    """The paths those rounds' undo would write (from their journals, else their full backups' manifests)."""
    paths: list[str] = []
    for r in rounds:
        journal = backups / f"round_{r}.journal"
        try:
            entries = [e["path"] for e in read_journal(journal) if e["was"] != "dir"] if journal.is_file() \
                else _manifest(backups, r)
        except BackupError:
            continue
        paths += [p for p in entries if p not in paths]
    return paths


def _nothing_to_roll_back(recipe_dir: Path, round_no: int | None) -> BackupError:
    """Why there is no round of the latest run to undo, in one line naming what an undo would overwrite."""
    backups = state_dir(recipe_dir) / "backup"
    where = "/".join((*state_parts(recipe_dir), "backup"))
    rounds = backup_rounds(recipe_dir)
    run_id = _current_run(backups) if backups.is_dir() else ""
    undone = sorted(backups.glob("rolled_back/*/round_*.run")) if backups.is_dir() else []
    if round_no is not None:
        undone = [p for p in undone if p.name == f"round_{round_no}.run"]
    which = f"repair round {round_no}" if round_no is not None else "repair rounds"
    when = max((p.parent.name for p in undone), default="")
    if any(_stamp(p.parent, int(ROUND_DIR_RE.match(p.name).group(1))) == run_id for p in undone):
        return BackupError(f"{recipe_dir}: the last run's {which} were rolled back already ({when}, kept in "
                           f"{where}/rolled_back/); nothing to roll back")
    earlier = [r for r in rounds if round_no is None or r == round_no]
    if earlier:
        files = _touched(backups, earlier)
        shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        return BackupError(f"{recipe_dir}: the last run made no repair; round(s) {earlier} are of an earlier run, "
                           f"and undoing them would overwrite {shown or 'the recipe'} as it is now; nothing rolled "
                           f"back (their backup stays in {where}/)")
    if round_no is not None and latest_run_rounds(recipe_dir):
        return BackupError(f"{recipe_dir}: no backup for round {round_no} of the last run (have "
                           f"{latest_run_rounds(recipe_dir)})")
    if undone or (backups / "earlier").is_dir():
        before = f"; the rounds of an earlier run were rolled back already ({when})" if undone else ""
        return BackupError(f"{recipe_dir}: the last run made no repair{before}; nothing to roll back")
    return BackupError(f"{recipe_dir}: no repair backups under {where}/; nothing to roll back")


def _changed_since(recipe_dir: Path, backups: Path, undo: list[int]) -> list[tuple[str, int]]:
    """Paths the undo would overwrite that are no longer as the last round touching them left them."""
    expected: dict[str, tuple[str, int]] = {}
    for r in sorted(undo):        # the last round that touched a path says what it left there
        journal = backups / f"round_{r}.journal"
        after = _read_after(backups, r)
        for entry in read_journal(journal) if journal.is_file() else []:
            if entry["was"] == "dir":
                continue
            if after is None or entry["path"] not in after:
                expected.pop(entry["path"], None)       # nothing recorded to hold it to
            else:
                expected[entry["path"]] = (after[entry["path"]], r)
    return [(rel, r) for rel, (state, r) in sorted(expected.items()) if _path_state(recipe_dir / rel) != state]


def rollback(recipe_dir: Path, round_no: int | None = None, *, force: bool = False) -> tuple[int, list[str]]:
    """Restore the recipe as it was before round N (default: the first) of the latest run's rounds: each
    round from the last back to N undoes what its journal lists — changed files get their original bytes
    and mode, removed links and files come back, files the round created move to .migrator/trash/<time>/ —
    and then moves to backup/rolled_back/ (undone once). Files nobody's repair touched (the user's own,
    made since) are left alone. Refused (BackupError, one line, nothing changed): the latest run made no
    repair, the round was undone already, or a file the undo would overwrite changed since the round left
    it (unless `force`: it goes to the trash). Nothing is written through a symlink (one in the way is moved
    to the trash). A full backup of an earlier release (round_N.manifest.json) is restored as that release did."""
    recipe_dir = Path(recipe_dir)
    rounds = latest_run_rounds(recipe_dir)
    if not rounds or (round_no is not None and round_no not in rounds):
        raise _nothing_to_roll_back(recipe_dir, round_no)
    round_no = rounds[0] if round_no is None else round_no
    backups = state_dir(recipe_dir) / "backup"
    undo = [r for r in rounds if r >= round_no]
    if not force:
        changed = _changed_since(recipe_dir, backups, undo)
        if changed:
            shown = ", ".join(f"{rel} (round {r})" for rel, r in changed[:3]) + \
                (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            raise BackupError(f"{recipe_dir}: rolling back would overwrite {shown}, changed since the repair wrote "
                              f"{'them' if len(changed) > 1 else 'it'}; nothing rolled back: keep your change, or "
                              "roll back with --force (what it replaces goes to "
                              f"{'/'.join((*state_parts(recipe_dir), 'trash'))}/)")
    changes = undo_rounds(recipe_dir, round_no, rounds)
    _archive_rounds(recipe_dir, backups, "rolled_back", set(undo))
    return round_no, changes


def undo_rounds(recipe_dir: Path, round_no: int, rounds: list[int] | None = None) -> list[str]:
    """Undo rounds `round_no` and later (of `rounds`, default all present) as their journals say, without
    the checks of `rollback` and keeping them in place: a round cut short by a kill is undone so before it
    runs again (agent.repair.fix)."""
    recipe_dir = Path(recipe_dir)
    rounds = backup_rounds(recipe_dir) if rounds is None else rounds
    if round_no not in rounds:
        raise FileNotFoundError(f"{recipe_dir}: no backup for round {round_no} (have {rounds})")
    backups = state_dir(recipe_dir) / "backup"
    if not (backups / f"round_{round_no}.journal").is_file():
        return _rollback_full(recipe_dir, round_no)
    undo = [r for r in rounds if r >= round_no and (backups / f"round_{r}.journal").is_file()]
    journals = {r: read_journal(backups / f"round_{r}.journal") for r in undo}   # all checked before any change
    for r, entries in journals.items():
        saved = _regular_files(backups / f"round_{r}")
        for entry in entries:
            if entry["was"] == "file" and entry["path"] not in saved:
                raise BackupError(f"{backups / f'round_{r}'}: {entry['path']} is missing from the backup or not "
                                  "a regular file")
    trash = _Trash(recipe_dir)
    changes: list[str] = []
    with WriteGuard(recipe_dir, keep_links=False):      # nothing restored or moved through a link out of the recipe
        for r in sorted(undo, reverse=True):
            changes += _undo_round(recipe_dir, backups / f"round_{r}", journals[r], trash)
    return changes


def _make_parents(recipe_dir: Path, rel: str, trash: "_Trash", changes: list[str]) -> None:
    parent = recipe_dir
    for part in Path(rel).parts[:-1]:
        parent = parent / part
        if parent.is_symlink() or (parent.exists() and not parent.is_dir()):
            moved = trash.put(parent.relative_to(recipe_dir).as_posix())
            changes.append(f"moved {parent.relative_to(recipe_dir).as_posix()} to {moved}")
        _rollback_tree(recipe_dir).mkdir(parent, parents=False)


def _undo_round(recipe_dir: Path, source: Path, entries: list[dict], trash: "_Trash") -> list[str]:
    changes: list[str] = []
    # folders first (files go back into them), created paths deepest first
    order = sorted(entries, key=lambda e: (e["was"] != "dir", e["path"].count("/")))
    for entry in order:
        rel, was = entry["path"], entry["was"]
        target = recipe_dir / rel
        if was == "dir":
            _make_parents(recipe_dir, rel + "/x", trash, changes)
        elif was == "absent":
            inside = Path(os.path.realpath(target.parent)) == (recipe_dir.resolve() / rel).parent
            if inside and os.path.lexists(target):
                changes.append(f"moved {rel} (created by the repair) to {trash.put(rel)}")
        elif was == "link":
            if target.is_symlink() and os.readlink(target) == entry["target"]:
                continue
            _make_parents(recipe_dir, rel, trash, changes)
            if os.path.lexists(target):
                trash.put(rel)
            _rollback_tree(recipe_dir).symlink(entry["target"], target)    # read_journal: the target stays inside
            changes.append(f"restored link {rel}")
        else:
            data = (source / rel).read_bytes()
            _make_parents(recipe_dir, rel, trash, changes)
            if target.is_symlink() or (target.exists() and not target.is_file()):
                changes.append(f"moved {rel} to {trash.put(rel)}")
            elif target.exists():
                if target.read_bytes() == data and stat.S_IMODE(os.lstat(target).st_mode) == entry["mode"]:
                    continue
                trash.put(rel)
            atomic_write(target, data, entry["mode"], root=recipe_dir)
            changes.append(f"restored {rel}")
    return changes


def _rollback_full(recipe_dir: Path, round_no: int) -> list[str]:
    """A full backup (every regular recipe file, written by earlier releases)."""
    backups = state_dir(recipe_dir) / "backup"
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
            _rollback_tree(recipe_dir).mkdir(parent, parents=False)
        target = recipe_dir / rel
        if target.is_symlink() or (target.exists() and not target.is_file()):
            restored.append(f"moved {rel} to {trash.put(rel)}")
        elif target.exists():
            if target.read_bytes() == data and stat.S_IMODE(os.lstat(target).st_mode) == stat.S_IMODE(mode):
                continue
            trash.put(rel)
        atomic_write(target, data, mode, root=recipe_dir)
        restored.append(f"restored {rel}")
    return restored


def _rollback_tree(recipe_dir: Path):
    """The recipe's tree for rollback: a link out of the recipe may itself be moved to the trash."""
    return user_tree(recipe_dir, keep_links=False)


def has_backups(recipe_dir: Path) -> bool:
    """Whether the latest run's repair rounds backed the recipe up and are not undone yet (what `rollback`
    restores)."""
    try:
        return bool(latest_run_rounds(recipe_dir))
    except (OSError, UnsafeRecipePath):
        return False
