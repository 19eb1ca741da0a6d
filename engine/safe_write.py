"""The one way the migrator and a recipe write a user's files (SPEC §6): a recipe, a checkout, a
checkpoint folder, the caches we fill. Every write, rename, delete, mkdir and chmod into such a
folder goes through a `UserTree` anchored at that folder (its root).

It lives in engine/ because a standalone recipe carries engine/ and writes its own files (baselines,
parity dumps, logs) the same way without infer-migrator installed: stdlib only, nothing from agent/.
tests/lint/test_writes_through_safe_write.py walks the code and fails on a direct write anywhere else.

What a UserTree promises:
- **Nothing lands outside its root.** Before anything is written, the path is resolved: every
  folder above it and the entry itself. A symlink (at the top of the tree or deep in it, to a file
  or a folder) whose target stays inside the root is followed; one whose resolution leaves the root
  is refused with one line naming the link (`WriteRefused`, exit 2 in the CLI), whatever its name.
  The folders are then opened one by one from the root with O_NOFOLLOW, and the write happens
  relative to the last one, so a link swapped in after the check is refused, not followed.
- **A file with other hard links is never edited in place.** Writes are write-and-rename: a new
  file is written beside the old one and renamed over it, so another name of the old file keeps the
  old bytes (and a reader never sees half a file). Appending, which cannot be done that way, is
  refused on a file with other links; a chmod of one is done by copy-and-rename.
- **Modes are permission bits only** (`& 0o777`): no setuid, setgid or sticky bit is ever set.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import sys
import tempfile
import threading

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

PERMISSION_BITS = 0o777
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
TEMP_PREFIX = ".migrator-tmp-"      # a write's own file beside its destination, until the rename


class WriteRefused(ValueError):
    """A write the tree refuses (it would land outside the root, or edit a hard-linked file in place):
    one line naming the link and what to do."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def permission_bits(mode: int | None) -> int | None:
    return None if mode is None else stat.S_IMODE(int(mode)) & PERMISSION_BITS


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


class UserTree:
    """Writes into the folder `root`, never outside it (see the module docs). Paths may be absolute
    (inside `root` as written) or relative to `root`. `what` names the folder in a refusal ("the
    recipe", "the checkout"). `error`: the exception class of a refusal (a subclass of WriteRefused:
    infer-migrator's carries its exit code)."""

    def __init__(self, root: str | os.PathLike, what: str = "the folder", error: type[WriteRefused] = WriteRefused,
                 *, create: bool = False, keep_links: bool = True):
        if create:                       # the root is where the caller writes: a cache we fill, an output folder
            try:
                os.makedirs(root, 0o777, exist_ok=True)
            except FileExistsError:      # a file, or a link to nothing, where the folder is to be
                shown = f"a symlink to {os.readlink(root)} that leads nowhere" if os.path.islink(root) else \
                    "not a folder"
                raise error(f"{root} is {shown}; the migrator makes {what} there: move it away and re-run") from None
        self.root = Path(os.path.abspath(root))
        self.real_root = Path(os.path.realpath(root))
        self.what = what
        self.error = error
        # True: a link out of the root is not removed or replaced either (a repair would detach the
        # folder from the file the user linked); False for a folder of links we made (a cache)
        self.keep_links = keep_links

    def __repr__(self) -> str:
        return f"UserTree({str(self.root)!r})"

    # ---- where a path lands --------------------------------------------------------------------
    def _lexical(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        # a relative path is the caller's, from the working directory (a recipe named `fi` on the command
        # line), as every file API reads it; one that lands outside the root is taken from the root instead
        full = Path(os.path.abspath(path))
        if not path.is_absolute() and not any(full == root or root in full.parents for root in (self.root, self.real_root)):
            full = Path(os.path.abspath(self.root / path))
        for root in (self.root, self.real_root):
            try:
                full.relative_to(root)
                return full
            except ValueError:
                continue
        raise self.error(f"{full} is not inside {self.what} {self.root}; the migrator writes there only")

    def _inside(self, real: Path) -> bool:
        return real == self.real_root or self.real_root in real.parents

    def _refuse_link(self, lexical: Path, action: str) -> WriteRefused:
        """The refusal naming the first link on `lexical` whose resolution leaves the root."""
        for root in (self.root, self.real_root):
            try:
                rel = lexical.relative_to(root)
                break
            except ValueError:
                continue
        else:
            rel, root = lexical, self.root
        link, probe = lexical, root
        for part in rel.parts:
            probe = probe / part
            if probe.is_symlink() and not self._inside(Path(os.path.realpath(probe))):
                link = probe
                break
        try:
            shown = link.relative_to(root).as_posix()
        except ValueError:
            shown = str(link)
        return self.error(f"{shown} is a symlink to {os.path.realpath(link)}, outside {self.what} {self.root}; the "
                          f"migrator writes only inside {self.what} ({action} of {rel.as_posix()} refused): replace "
                          "the link with a copy (e.g. cp -r --remove-destination) or remove it, then re-run")

    def resolve(self, path: str | os.PathLike, action: str = "write", follow: bool = True) -> Path:
        """Where a write to `path` lands (its real path), refused when that is outside the root.
        `follow`: a symlink at `path` itself counts as what it points at (a write into the file);
        False: the entry itself (an unlink or rename of the link) — its folder must be inside."""
        lexical = self._lexical(path)
        _announce(action, lexical)    # a process-wide guard (a repair round's) checks it first, by its own root
        if lexical in (self.root, self.real_root):

            if action != "mkdir":
                raise self.error(f"{lexical}: is {self.what} itself; refusing to {action} it")
            return self.real_root
        real_parent = Path(os.path.realpath(lexical.parent))

        if not self._inside(real_parent):
            raise self._refuse_link(lexical, action)
        target = real_parent / lexical.name
        if follow and os.path.islink(target):
            resolved = Path(os.path.realpath(target))
            if not self._inside(resolved):
                raise self._refuse_link(lexical, action)
            target = resolved
        elif not follow and self.keep_links and os.path.islink(target) \
                and not self._inside(Path(os.path.realpath(target))):

            # removing or replacing a link out of the tree would detach the folder from the user's file
            raise self._refuse_link(lexical, action)
        if target == self.real_root and action != "mkdir":
            raise self.error(f"{lexical}: is {self.what} itself; refusing to {action} it")
        return target

    @contextmanager
    def _parent_fd(self, real: Path, action: str, create: bool = False) -> Iterator[int]:
        """An fd of `real`'s folder, opened component by component from the root with O_NOFOLLOW
        (created when `create`): a link swapped in since `resolve` is refused, not followed. While it is
        open, the write is announced (see `in_tree_write`)."""
        rel = real.parent.relative_to(self.real_root)
        _announce(action, real)
        _op.depth = getattr(_op, "depth", 0) + 1
        try:
            fd = os.open(self.real_root, _DIR_FLAGS)
        except BaseException:
            _op.depth -= 1
            raise
        try:

            here = self.real_root
            for part in rel.parts:
                here = here / part
                try:
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        _announce("mkdir", here)
                        os.mkdir(part, 0o777, dir_fd=fd)
                    except FileExistsError:
                        pass
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise self.error(f"{real.parent}: a folder on the way to {real.name} is a symlink or not a "
                                         f"folder (changed while the migrator wrote); {action} refused: move it "
                                         "away and re-run") from None
                    raise
                os.close(fd)
                fd = nxt
            yield fd
        finally:
            os.close(fd)
            _op.depth -= 1

    # ---- writes ---------------------------------------------------------------------------------
    def write_bytes(self, path: str | os.PathLike, data: bytes, mode: int | None = None,
                    keep_mode: bool = True) -> Path:
        """Write-and-rename: a new file beside the destination, renamed over it. `mode` (permission
        bits only); None: the old file's permission bits when `keep_mode`, else the umask's."""
        real = self.resolve(path, "write")
        with self._parent_fd(real, "write", create=True) as dfd:
            try:
                old = os.stat(real.name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                old = None
            if old is not None and stat.S_ISDIR(old.st_mode):
                raise self.error(f"{path} is a folder where the migrator writes a file; move it away and re-run")
            if mode is None:
                mode = stat.S_IMODE(old.st_mode) if (old is not None and keep_mode) else _default_mode()
            self._write_and_rename(dfd, real.name, data, mode)
        return real

    def write_text(self, path: str | os.PathLike, text: str, encoding: str = "utf-8", mode: int | None = None,
                   errors: str = "strict") -> Path:
        return self.write_bytes(path, text.encode(encoding, errors), mode)

    def _write_and_rename(self, dfd: int, name: str, data: bytes, mode: int) -> None:
        tmp = f"{TEMP_PREFIX}{name[:100]}.{os.urandom(6).hex()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                     0o600, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                os.fchmod(f.fileno(), permission_bits(mode))
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise

    def append_bytes(self, path: str | os.PathLike, data: bytes, sync: bool = False) -> Path:
        """Append to a file (created if missing). Refused on a file with other hard links."""
        with self.open(path, "ab") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        return self.resolve(path, "append")

    def open(self, path: str | os.PathLike, mode: str = "w", encoding: str | None = None, **kwargs):
        """A file object for streaming writes ("w", "wb", "a", "ab", "x", "xb"). "w" replaces the entry
        (a new file, never the old one truncated in place); "a" refuses a file with other hard links."""
        if not set(mode) <= set("wabxt") or not set(mode) & set("wax"):
            raise ValueError(f"UserTree.open: mode {mode!r} is not a write mode")
        real = self.resolve(path, "write")
        binary = "b" in mode
        with self._parent_fd(real, "write", create=True) as dfd:
            flags = os.O_WRONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
            if "a" in mode:
                flags |= os.O_APPEND | os.O_CREAT
            else:
                flags |= os.O_CREAT | os.O_EXCL
                if "w" in mode:
                    try:
                        old = os.stat(real.name, dir_fd=dfd, follow_symlinks=False)
                        if stat.S_ISDIR(old.st_mode):
                            raise self.error(f"{path} is a folder where the migrator writes a file; move it away")
                        os.unlink(real.name, dir_fd=dfd)
                    except FileNotFoundError:
                        pass
            fd = os.open(real.name, flags, _default_mode(), dir_fd=dfd)
        try:
            st = os.fstat(fd)
            if "a" in mode and st.st_nlink > 1:
                raise self.error(f"{path} has {st.st_nlink - 1} other hard link(s); the migrator never edits such a "
                                 "file in place (appending would change the other names too): replace it with a "
                                 "copy (cp --remove-destination) and re-run")
            if not stat.S_ISREG(st.st_mode):
                raise self.error(f"{path} is not a regular file; the migrator writes only regular files: move it away")
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, mode if binary else mode.replace("t", ""),
                         encoding=None if binary else (encoding or "utf-8"), **kwargs)

    def open_lock(self, path: str | os.PathLike, mode: int = 0o644) -> int:
        """A file descriptor (read-write, created if missing) of a lock file, for flock: never through a
        link, never a file with other hard links (the holder's pid is written into it)."""
        real = self.resolve(path, "lock")
        with self._parent_fd(real, "lock", create=True) as dfd:
            fd = os.open(real.name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                         permission_bits(mode), dir_fd=dfd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            os.close(fd)
            raise self.error(f"{path}: a lock file that is not a regular file of its own (a hard link or a special "
                             "file); remove it and re-run")
        return fd

    def mkdir(self, path: str | os.PathLike, parents: bool = True, exist_ok: bool = True) -> Path:

        """A folder (and its parents), each a real folder inside the root."""
        real = self.resolve(path, "mkdir")
        if real == self.real_root:
            return real
        with self._parent_fd(real, "mkdir", create=parents) as dfd:
            try:
                os.mkdir(real.name, 0o777, dir_fd=dfd)
            except FileExistsError:
                if not exist_ok:
                    raise
                st = os.stat(real.name, dir_fd=dfd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    raise self.error(f"{path} is a file, not a folder; the migrator writes files into it: move your "
                                     "file away and re-run") from None
        return real

    def unlink(self, path: str | os.PathLike, missing_ok: bool = True) -> None:
        """Remove a file or a link (the entry itself; a link out of the root is refused, not removed)."""
        real = self.resolve(path, "unlink", follow=False)
        try:
            with self._parent_fd(real, "unlink") as dfd:
                os.unlink(real.name, dir_fd=dfd)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmtree(self, path: str | os.PathLike, missing_ok: bool = True) -> None:
        """Remove a folder and what it holds; links inside are removed, never followed."""
        real = self.resolve(path, "rmtree", follow=False)
        try:
            with self._parent_fd(real, "rmtree") as dfd:
                st = os.stat(real.name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(real.name, dir_fd=dfd)
                else:
                    os.unlink(real.name, dir_fd=dfd)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def replace(self, src: str | os.PathLike, dst: str | os.PathLike) -> Path:
        """Rename the entry `src` to `dst` (replacing what is there), both inside the root."""
        real_src = self.resolve(src, "rename", follow=False)
        real_dst = self.resolve(dst, "rename", follow=False)
        with self._parent_fd(real_src, "rename") as sfd, self._parent_fd(real_dst, "rename", create=True) as dfd:
            os.rename(real_src.name, real_dst.name, src_dir_fd=sfd, dst_dir_fd=dfd)
        return real_dst

    rename = replace

    def chmod(self, path: str | os.PathLike, mode: int) -> None:
        """Set permission bits (only). A file with other hard links gets a copy of its own first."""
        real = self.resolve(path, "chmod")
        bits = permission_bits(mode)
        with self._parent_fd(real, "chmod") as dfd:
            fd = os.open(real.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                         dir_fd=dfd)
            try:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                    with os.fdopen(os.dup(fd), "rb") as f:
                        data = f.read()
                    self._write_and_rename(dfd, real.name, data, bits)
                elif stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
                    os.fchmod(fd, bits)
                else:
                    raise self.error(f"{path} is not a regular file or folder; the migrator changes no other mode")
            finally:
                os.close(fd)

    def copy(self, src: str | os.PathLike, dst: str | os.PathLike, mode: int | None = None,
             max_bytes: int | None = None) -> Path:
        """Copy the regular file `src` (from anywhere) to `dst` in the tree, write-and-rename;
        `mode` default: src's permission bits."""
        fd = os.open(src, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise self.error(f"{src} is not a regular file; the migrator copies only regular files")
            if max_bytes is not None and st.st_size > max_bytes:
                raise self.error(f"{src}: {st.st_size} bytes, more than the {max_bytes} a copy may take")
            data = f.read()
        return self.write_bytes(dst, data, stat.S_IMODE(st.st_mode) if mode is None else mode)

    def copy_tree(self, src: str | os.PathLike, dst: str | os.PathLike) -> Path:
        """Copy the folder `src` (regular files and folders; links are not followed, not copied) to `dst`."""
        src = Path(src)
        self.mkdir(dst)
        for dirpath, dirnames, filenames in os.walk(src, followlinks=False):
            base = Path(dirpath)
            rel = base.relative_to(src)
            for d in dirnames:
                if not (base / d).is_symlink():
                    self.mkdir(Path(dst) / rel / d)
            for name in filenames:
                if stat.S_ISREG(os.lstat(base / name).st_mode):
                    self.copy(base / name, Path(dst) / rel / name)
        return self.resolve(dst, "mkdir")

    def symlink(self, target: str | os.PathLike, path: str | os.PathLike) -> Path:
        """A symlink at `path` (replacing an entry there) to `target`: the link's own place is checked; a
        link pointing out of the root is what a checkpoint folder of links to the hub's blobs is."""
        real = self.resolve(path, "link", follow=False)
        with self._parent_fd(real, "link", create=True) as dfd:
            tmp = f"{TEMP_PREFIX}{real.name[:100]}.{os.urandom(6).hex()}"
            os.symlink(target, tmp, dir_fd=dfd)
            try:
                os.rename(tmp, real.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                os.unlink(tmp, dir_fd=dfd)
                raise
        return real

    def write_with(self, path: str | os.PathLike, writer: Callable[[str], object], mode: int | None = None) -> Path:
        """A file written by a library (`writer(temp_path)`, e.g. torch.save): into a new file beside the
        destination, renamed over it once complete."""
        real = self.resolve(path, "write")
        self.mkdir(real.parent)
        with self._parent_fd(real, "write") as dfd:
            tmp = f"{TEMP_PREFIX}{real.name[:100]}.{os.urandom(6).hex()}"
            try:
                writer(str(real.parent / tmp))
                st = os.stat(tmp, dir_fd=dfd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    raise self.error(f"{path}: the writer left no regular file")
                os.chmod(tmp, permission_bits(_default_mode() if mode is None else mode), dir_fd=dfd)
                os.rename(tmp, real.name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
                raise
        return real

    def fill_with(self, folder: str | os.PathLike, writer: Callable[[str], object], scratch=None) -> Path:
        """A folder filled by a library (`writer(temp_folder)`, e.g. save_pretrained): into a private
        folder first, then copied in file by file (checked like any write). `scratch`: a context manager
        that gives that folder (infer-migrator passes its owned_temp, which the next command removes if a
        SIGKILL leaves it); default a plain temporary folder."""
        real = self.mkdir(folder)
        with scratch if scratch is not None else tempfile.TemporaryDirectory(prefix="fill-") as tmp:
            writer(str(tmp))
            self.copy_tree(tmp, real)
        return real


# ---- what other guards see ------------------------------------------------------------------------
# A tree's operations use file descriptors (openat, renameat, fchmod), whose audit events name a path
# relative to a folder descriptor or no path at all. Each operation is therefore announced as the audit
# event "migrator.write" (action, (path,)): the path as given before the tree checks it (so a guard with a
# wider root refuses it first, naming the link from its root), and its real path as it is written. A
# process-wide guard (agent.recipe.fs_guard's

# WriteGuard: checks and backs up every write of a repair round) reads that, and ignores the raw events
# while `in_tree_write()`.
_op = threading.local()
WRITE_EVENT = "migrator.write"


def _announce(action: str, real: Path) -> None:
    sys.audit(WRITE_EVENT, action, (str(real),))


def in_tree_write() -> bool:
    return getattr(_op, "depth", 0) > 0


def tree_of(path: str | os.PathLike, what: str = "the folder", error: type[WriteRefused] = WriteRefused) -> UserTree:
    """The tree whose root is `path`'s folder: only for a single file the user (or a caller) named to be
    written (an --output file), where no larger root exists. A file of a recipe, a checkout or a cache is
    written in the tree of that root, so that a link anywhere between the root and the file is refused
    (tests/lint/test_writes_through_safe_write.py lists the few callers of this one)."""
    return UserTree(Path(os.path.abspath(path)).parent, what, error)


# A recipe's run writes its logs, dump and records into the run folder the migrator made and checked in
# the recipe; the migrator names that recipe here, and a run's writers anchor their tree there (a link
# swapped in anywhere between the recipe and the run folder is refused). A run started by hand has none:
# its folder is its tree.
WRITE_ROOT_ENV = "MIGRATOR_WRITE_ROOT"


def run_folder_tree(folder: str | os.PathLike, what: str = "the run folder", *, create: bool = False) -> UserTree:
    """The tree a run's writer writes `folder` in: the recipe of WRITE_ROOT_ENV when `folder` lies in it
    (created, when `create`, through that tree), else `folder` itself."""
    folder = Path(os.path.abspath(folder))
    root = os.environ.get(WRITE_ROOT_ENV)
    if root and os.path.isabs(root):
        tree = UserTree(root, "the recipe")
        if folder == tree.root or tree.root in folder.parents:
            if create:
                tree.mkdir(folder)
            return tree
    return UserTree(folder, what, create=create)
