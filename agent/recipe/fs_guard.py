"""What the migrator may read and write in a folder it was handed (SPEC §6: recipes and checkpoints
are untrusted).

Reads: only regular files are read, at most a bounded number of bytes. A FIFO, a device (a link to
/dev/zero), a socket, a folder where a file is expected or a symlink loop is refused by its type
with one line (exit 2), before it is opened for reading — never read, never waited on.

Writes go through engine/safe_write.py's UserTree (`user_tree(root)` here: refusals exit 2), the one
writer of a user's files. In addition, while a `WriteGuard` is active, every write the process makes to a path inside the guarded

recipe (open for writing, unlink, rename, rmtree, chmod, ...) is checked before it happens, through
Python's audit hooks: a path that lies in the recipe but resolves outside it (a symlinked file,
`config/` or `models/` linked to a shared folder) is refused with one line naming the link, so the
migrator never writes outside a recipe. A guard with a `backup` (a repair round) also copies each
file the first time it is about to change — copy-on-write — so a round's backup holds exactly what
that round changed, and rollback can restore it.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import threading
from pathlib import Path

from agent.errors import InputError, describe_fault
from engine.safe_write import TEMP_PREFIX, WRITE_EVENT, UserTree, WriteRefused, in_tree_write

SOURCE_LIMIT = 16 * 2**20          # a recipe's Python, YAML, shell: far larger is not a source file
JSON_LIMIT = 1 * 2**30             # tokenizer.json and the like can be large; /dev/zero cannot pass
KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
         stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder", stat.S_IFLNK: "a symlink"}


class UnreadableFile(InputError):
    """A path that is not a regular file (or too large) where the migrator expects one."""


class WriteOutsideRecipe(InputError, WriteRefused):
    """A write into a recipe that would land outside it (through a symlink): exit 2."""


def user_tree(root: Path, what: str = "the recipe", **options) -> UserTree:
    """engine.safe_write's UserTree anchored at `root` (a recipe, a checkout, a cache we fill), its
    refusals exit 2: the one way agent/ writes a user's files. `options`: create, keep_links."""
    return UserTree(root, what, WriteOutsideRecipe, **options)



def parent_tree(path: Path, what: str = "its folder") -> UserTree:
    """The tree of `path`'s own folder: for a file whose caller knows no larger root (a recipe file
    handed to a codemod, a file the user named); a link at `path` out of that folder is refused."""
    return UserTree(Path(os.path.abspath(path)).parent, what, WriteOutsideRecipe)


def _kind(mode: int) -> str:
    return KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _shown(path: Path, root: Path | None) -> str:
    if root is not None:
        try:
            return Path(path).relative_to(root).as_posix()
        except ValueError:
            pass
    return str(path)


def check_regular(path: Path, root: Path | None = None, limit: int | None = None) -> os.stat_result:
    """stat() of a regular file (a symlink to one is fine), else one-line UnreadableFile."""
    path = Path(path)
    shown = _shown(path, root)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise _unreadable(path, shown, exc) from None
    if not stat.S_ISREG(st.st_mode):
        target = f" (a link to {os.path.realpath(path)})" if path.is_symlink() else ""
        raise UnreadableFile(f"{shown} is {_kind(st.st_mode)}{target}, not a regular file; the migrator reads "
                             "only regular files: replace it with the file it should be, or remove it")
    if limit is not None and st.st_size > limit:
        raise UnreadableFile(f"{shown}: {st.st_size} bytes, more than the {limit} a file of this kind may hold; "
                             "is it the right file?")
    return st


def _unreadable(path: Path, shown: str, exc: OSError) -> UnreadableFile:
    """Why a file handed to us cannot be stat'ed or opened, in one line: every errno, not only the ones
    foreseen (a dangling link, a folder without x permission, a name too long)."""
    if exc.errno == errno.ELOOP:
        return UnreadableFile(f"{shown}: a symlink loop (it points back at itself); remove it or point it at "
                              "a real file")
    if exc.errno == errno.ENOENT and os.path.islink(path):
        return UnreadableFile(f"{shown}: a symlink to {os.readlink(path)}, which does not exist (a dangling link); "
                              "remove it or point it at the real file")
    if exc.errno == errno.ENOENT:
        return UnreadableFile(f"{shown}: does not exist (removed while the migrator read the folder?); put it back "
                              "or remove what names it")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return UnreadableFile(f"{shown}: cannot be read by this user (permission denied); make it readable "
                              "(chmod u+r, and u+x on its folders)")
    return UnreadableFile(f"{shown}: cannot be read ({exc.strerror or exc}); replace it with the file it should be")


def read_bytes(path: Path, limit: int = SOURCE_LIMIT, root: Path | None = None) -> bytes:
    """The bytes of a regular file, refused (one line) when it is anything else or larger than
    `limit`. Opened non-blocking and checked again on the open file, so a FIFO swapped in meanwhile
    is not waited on either."""
    check_regular(path, root, limit)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise _unreadable(path, _shown(path, root), exc) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFile(f"{_shown(path, root)} is {_kind(st.st_mode)}, not a regular file; remove it")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 2**20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise UnreadableFile(f"{_shown(path, root)}: more than {limit} bytes; is it the right file?")
    return data


def read_text(path: Path, limit: int = SOURCE_LIMIT, root: Path | None = None, errors: str = "replace") -> str:
    return read_bytes(path, limit, root).decode("utf-8", errors=errors)


def source_files(root: Path, suffixes: tuple[str, ...] = (".py",), skip_dirs=frozenset()) -> list[Path]:
    """Files under `root` with these suffixes, sorted, folders symlinked inside never followed (a loop
    cannot recurse). Entries that are not regular files (a FIFO named x.py, a link to /dev/zero, a
    symlink loop) are refused with one line; a folder named x.py is a folder, not a source."""
    root = Path(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        base = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)
        for d in dirnames:       # os.walk lists a symlink to a folder (or a dangling/looping one) as a folder
            if d.endswith(suffixes) and (base / d).is_symlink() and not (base / d).is_dir():
                check_regular(base / d, root)
        for name in sorted(filenames):
            if name.endswith(suffixes):
                path = base / name
                check_regular(path, root, SOURCE_LIMIT)
                found.append(path)
    return sorted(found)


# ---- writes ---------------------------------------------------------------------------------
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_local = threading.local()
_active: list["WriteGuard"] = []
_hook_installed = False


def _fs_path(value, dir_fd=None) -> str | None:
    if isinstance(value, int) or value is None:
        return None
    try:
        text = os.fsdecode(os.fspath(value))
    except TypeError:
        return None
    if dir_fd is not None and not os.path.isabs(text):
        try:
            text = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), text)
        except OSError:
            return None
    return os.path.abspath(text)


def _written_paths(event: str, args: tuple) -> list[tuple[str, str]]:
    """(path, what) the event is about to change; [] for reads and events that change nothing."""
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None, None))[:3]
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                 (mode is None and isinstance(flags, int) and flags & _WRITE_FLAGS)
        return [(p, "write")] if writes and (p := _fs_path(path)) else []
    if event in ("os.remove", "os.rmdir", "os.chmod", "os.chown", "os.truncate", "os.utime"):
        dir_fd = args[-1] if event in ("os.remove", "os.rmdir", "os.chmod", "os.chown") and len(args) > 1 \
            and isinstance(args[-1], int) else None
        p = _fs_path(args[0], dir_fd)
        return [(p, event.removeprefix("os."))] if p else []
    if event == "os.rename":
        src, dst = _fs_path(args[0], args[2] if len(args) > 2 else None), _fs_path(args[1], args[3] if len(args) > 3 else None)
        return [(p, "rename") for p in (src, dst) if p]
    if event in ("os.symlink", "os.link"):
        p = _fs_path(args[1], args[2] if event == "os.symlink" and len(args) > 2 else None)
        return [(p, "link")] if p else []
    if event == "shutil.rmtree":
        p = _fs_path(args[0], args[1] if len(args) > 1 else None)
        return [(p, "rmtree")] if p else []
    if event == "os.mkdir":
        p = _fs_path(args[0], args[2] if len(args) > 2 else None)
        return [(p, "mkdir")] if p else []
    return []


_TREE_ACTIONS = {"lock": "write", "unlink": "remove"}      # engine.safe_write's action names, as this guard's


def _audit(event: str, args: tuple) -> None:
    if not _active or getattr(_local, "busy", False):
        return
    if event == WRITE_EVENT:        # a UserTree's write, announced with its real path
        changes = [(p, _TREE_ACTIONS.get(args[0], args[0])) for p in args[1]]
    elif in_tree_write():           # the raw events of that write (paths relative to folder descriptors)
        return
    else:
        changes = _written_paths(event, args)

    if not changes:
        return
    guard = _active[-1]
    _local.busy = True
    try:
        for path, what in changes:
            guard.before_write(path, what)
    finally:
        _local.busy = False


class WriteGuard:
    """Context manager: writes into `recipe_dir` must stay inside it; with `on_change`, each path is
    reported (once, before its first change) so a backup can copy it first.

    `exempt`: recipe-relative top-level names whose writes are not reported (the migrator's own
    .migrator/ store, run folders); they are still checked for symlinks out of the recipe.
    `keep_links`: a symlink out of the recipe may not be removed or replaced either (a repair would
    detach the recipe from the file the user linked); rollback, which moves such links to the
    trash, passes False."""

    def __init__(self, recipe_dir: Path, on_change=None, exempt=frozenset({".migrator"}), keep_links: bool = True):
        self.root = Path(os.path.abspath(recipe_dir))
        self.real_root = Path(os.path.realpath(recipe_dir))
        self.on_change = on_change
        self.exempt = exempt
        self.seen: set[str] = set()
        self.refused: WriteOutsideRecipe | None = None
        self.keep_links = keep_links     # False: a link out of the recipe may itself be moved or replaced

    def __enter__(self) -> "WriteGuard":
        global _hook_installed
        if not _hook_installed:
            sys.addaudithook(_audit)      # permanent by design; inert while no guard is active
            _hook_installed = True
        _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active.remove(self)

    def _inside(self, path: Path, root: Path) -> str | None:
        try:
            rel = path.relative_to(root)
        except ValueError:
            return None
        return rel.as_posix()

    def before_write(self, path: str, what: str) -> None:
        lexical = Path(path)
        rel = self._inside(lexical, self.root)
        if rel is None:
            rel = self._inside(lexical, self.real_root)
        if rel is None:
            return                     # not in the recipe: not this guard's business
        # Where the write lands: for a write into a file, what the path resolves to; for an unlink,
        # rename or rmtree, the entry itself in its resolved folder — and when that entry is a
        # symlink, what it points at must be inside too (replacing such a link detaches the recipe
        # from the file the user linked).
        if what in ("write", "truncate", "chmod", "chown", "utime"):
            target = Path(os.path.realpath(lexical))
        else:
            target = Path(os.path.realpath(lexical.parent)) / lexical.name
            if self.keep_links and lexical.is_symlink() and self._inside(Path(os.path.realpath(lexical)), self.real_root) is None:
                target = Path(os.path.realpath(lexical))
        real_rel = self._inside(target, self.real_root)
        if real_rel is None or (real_rel == "." and what != "mkdir"):
            link = next((p for p in [*reversed(lexical.parents), lexical] if p.is_symlink()
                         and self._inside(p, self.root) not in (None, ".")), lexical)
            shown = self._inside(link, self.root) or str(link)
            self.refused = WriteOutsideRecipe(
                f"{shown} is a symlink to {os.path.realpath(link)}, outside the recipe {self.root}; the migrator "
                f"writes only inside a recipe ({what} of {rel} refused): replace the link with a copy "
                "(e.g. cp -r --remove-destination) and re-run")
            raise self.refused
        if self.on_change is not None and real_rel not in self.seen and real_rel.split("/")[0] not in self.exempt \
                and not target.name.startswith(TEMP_PREFIX):      # a write's own file, renamed over its target
            self.seen.add(real_rel)
            self.on_change(real_rel, what)


def check_write_destinations(recipe_dir: Path, destinations: dict[str, str]) -> None:
    """Before anything runs: the places the migrator will write in a recipe (`destinations`:
    recipe-relative path -> "dir" | "file") are absent, or real folders / regular files inside the
    recipe. A link out of it, or a file of the user's where a folder goes, is one line (exit 2)."""
    root = Path(os.path.realpath(recipe_dir))
    for rel, kind in destinations.items():
        path = Path(recipe_dir) / rel
        if not os.path.lexists(path):
            continue
        real = Path(os.path.realpath(path))
        if path.is_symlink() and root != real and root not in real.parents:
            raise WriteOutsideRecipe(f"{rel} is a symlink to {real}, outside the recipe {recipe_dir}; the migrator "
                                     f"writes {rel} inside the recipe: replace the link with a real "
                                     f"{'folder' if kind == 'dir' else 'file'} (or remove it) and re-run")
        if kind == "dir" and not path.is_dir():
            raise InputError(f"{path} is a file, not a folder; the migrator writes its {rel}/ files there: move "
                             f"your file away (e.g. mv {rel} {rel}.txt) and re-run")
        if kind == "file" and path.exists() and not path.is_file():
            raise InputError(f"{path} is not a regular file; the migrator writes {rel} there: move it away "
                             "and re-run")


def check_writable(folder: Path) -> None:
    """The migrator can create files in `folder` (a read-only mount, a folder without write
    permission, a full quota are one line, exit 74, before anything runs). The probe is an unnamed
    temporary file: nothing appears in the folder."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        fault = describe_fault(exc.errno, folder)
        if fault is not None:
            raise fault from None
        raise
