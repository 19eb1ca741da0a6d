"""Errors the CLI turns into one line on stderr and a distinct exit code."""

from __future__ import annotations

import errno
import os
from pathlib import Path

# Exit codes (documented in README.md and docs/exit-codes.md; tests/lint/test_readme.py holds both tables to these).
EXIT_OK = 0
EXIT_FAILED = 1          # the recipe still fails after the repair rounds
EXIT_USAGE = 2           # bad command line / bad input path or link
EXIT_UNSUPPORTED = 3     # architecture or checkpoint the migrator cannot serve
EXIT_ENVIRONMENT = 4     # requested device not usable (e.g. --device npu without NPU)
EXIT_NEEDS_WEIGHTS = 5   # weights too large to download: pass --weights PATH
EXIT_OOM = 6             # the model does not fit on one card: report written
EXIT_VENDOR = 7          # vendoring produced code that violates the recipe contract
EXIT_STANDIN_UNCOVERED = 8  # under the npu stand-in, a torch_npu op without a reference kernel was called
EXIT_NO_TRANSFORMERS_SOURCE = 9    # the checkout's transformers release: not here, its source not downloadable
EXIT_BAD_TRANSFORMERS_SOURCE = 10  # --transformers-source is no transformers 5.x source
EXIT_BUSY = 75           # another run of the same recipe / migration holds its lock (EX_TEMPFAIL)
EXIT_INTERNAL = 70       # a bug in the migrator: traceback saved to a file (EX_SOFTWARE)
EXIT_FILESYSTEM = 74     # disk full, a read-only recipe, a folder removed while the run used it (EX_IOERR)
EXIT_INTERRUPTED = 130   # SIGINT (Ctrl-C): the run's process tree is stopped; --resume continues
EXIT_TERMINATED = 143    # SIGTERM: the same


class MigratorError(Exception):
    exit_code = EXIT_FAILED

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class InputError(MigratorError):
    exit_code = EXIT_USAGE


class UnsupportedModelError(MigratorError):
    exit_code = EXIT_UNSUPPORTED


class EnvironmentProblem(MigratorError):
    exit_code = EXIT_ENVIRONMENT


class VendorError(MigratorError):
    exit_code = EXIT_VENDOR


RESUME_NOTE = " (--resume continues an interrupted migration)"      # `migrator run`'s; cli drops it elsewhere


class FilesystemFault(MigratorError):
    """The filesystem, not the migrator or the recipe: no space left, read-only, a folder removed
    while the run used it. One line naming the path; nothing to repair."""
    exit_code = EXIT_FILESYSTEM


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)


def _removed_folder(path: Path) -> Path | None:
    """The outermost missing folder above `path` whose parent still exists: what was removed."""
    missing = None
    for folder in path.parents:
        if folder.exists():
            return missing
        missing = folder
    return None


def describe_fault(errno_: int | None, path: str | os.PathLike | None) -> FilesystemFault | None:
    """A FilesystemFault for an errno on a path, or None when it is not a filesystem fault."""
    where = Path(path) if path else None
    shown = f"{where}: " if where is not None else ""
    again = "run the same command again" + RESUME_NOTE
    if errno_ in _NO_SPACE:
        return FilesystemFault(f"{shown}no space left on the device; free some space there, then {again}")
    if errno_ in _READ_ONLY:
        why = "read-only filesystem" if errno_ == errno.EROFS else "permission denied"
        return FilesystemFault(f"{shown}cannot be written ({why}); make it writable (or work on a writable "
                               f"copy), then {again}")
    if errno_ == errno.ENOENT and where is not None:
        removed = _removed_folder(where)
        if removed is not None:
            return FilesystemFault(f"{removed}: removed while the migrator was using it; {again}")
    return None


def _statvfs_errno(path: Path) -> int | None:
    """ENOSPC when the filesystem holding `path` is (nearly) full, EROFS when it is read-only."""
    folder = next((p for p in (path, *path.parents) if p.exists()), None)
    try:
        info = os.statvfs(folder)
    except (OSError, TypeError):
        return None
    if info.f_flag & os.ST_RDONLY:
        return errno.EROFS
    return errno.ENOSPC if info.f_bavail * info.f_frsize < 1024 * 1024 else None


def filesystem_fault(exc: BaseException, path: str | os.PathLike | None = None) -> FilesystemFault | None:
    """The filesystem fault behind an exception (an OSError, SQLite's "database or disk is full" /
    "readonly database" / "unable to open", or either as the cause of another exception), else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, FilesystemFault):
            return exc
        if isinstance(exc, OSError) and exc.errno is not None:
            fault = describe_fault(exc.errno, exc.filename or path)
            if fault is not None:
                return fault
        text = str(exc).lower()
        if type(exc).__module__ == "sqlite3" or "sqlite" in type(exc).__name__.lower():
            if "disk is full" in text or "disk full" in text:
                return describe_fault(errno.ENOSPC, path)
            if "readonly database" in text or "read-only" in text:
                return describe_fault(errno.EROFS, path)
            if "unable to open database" in text and path is not None:
                return describe_fault(errno.ENOENT, path)
            if "disk i/o error" in text and path is not None:   # SQLite says this of ENOSPC too
                return describe_fault(_statvfs_errno(Path(path)), path)
        exc = exc.__cause__ or exc.__context__
    return None
