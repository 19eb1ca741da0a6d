"""One writer per folder: every command that writes a recipe folder (`run` of a checkpoint into
OUTPUT/NAME, `run` and `baseline` of a recipe, `rollback`) holds an exclusive lock on that folder
for as long as it writes, whatever the command, its source or its options. A second writer is
refused with one line naming the holder (exit 75, try again later).

The lock is an flock on a file named by the folder's resolved path in the user's lock folder
($XDG_CACHE_HOME/infer-migrator/locks, default ~/.cache): a folder not made yet (the recipe a
migration is about to write) is locked too, and nothing is written into the folder or its parent.
The kernel drops the lock when the holder dies, even on SIGKILL."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import sys
import time
from pathlib import Path

from agent import errors
from agent.host import pid_namespace
from agent.paths import cache_home, outer_tempdir

_HELD: dict[str, list] = {}       # resolved folder -> [fd, depth]


def lock_dirs() -> list[Path]:
    """Where locks live: the user's cache, else (a read-only home) a folder of the user's in the temporary
    folder outside every process tree's own (agent.processes), so nested commands meet the same locks."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return [cache_home() / "infer-migrator" / "locks", outer_tempdir() / f"infer-migrator-locks-{uid}"]


def _key(folder: Path) -> str:
    return str(Path(folder).expanduser().resolve())


def hold(folder: Path, what: str, wait_s: float = 0.0) -> None:
    """Take the folder's lock (held until release(), or the process ends); refused with exit 75 while
    another process holds it (after waiting up to `wait_s` seconds for it). Taken again by the same
    process: counted, not refused."""
    key = _key(folder)
    if key in _HELD:
        _HELD[key][1] += 1
        return
    fd, problem = None, None
    for root in lock_dirs():
        try:
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            path = root / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".lock")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0),
                         0o600)
            break
        except OSError as exc:
            problem = problem or f"{root}: {exc.strerror or exc}"
    if fd is None:
        raise errors.EnvironmentProblem(f"the lock of {key} cannot be made ({problem}); set XDG_CACHE_HOME to a "
                                        "writable folder")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
        holder = holder_of(os.read(fd, 512).decode(errors="replace").strip())
        os.close(fd)
        raise errors.MigratorError(f"{key} is being written by another migrator command ({holder}); wait for it "
                                   f"to end or stop it, then {what} again", errors.EXIT_BUSY) from None
    os.ftruncate(fd, 0)
    os.write(fd, holder_line().encode()[:500])
    _HELD[key] = [fd, 1]


def holder_line() -> str:
    """What a lock file says of its holder (read back by holder_of)."""
    return f"pid {os.getpid()} @{pid_namespace() or '?'}: migrator {' '.join(sys.argv[1:3])}"


def holder_of(text: str) -> str:
    """Who holds a lock, as its file says: its pid only where that pid means something here (the same pid
    namespace of the same host); the holder of another namespace or host is named as such."""
    found = re.fullmatch(r"pid (\d+) @(\S+): (.*)", text, re.S)
    if found is None:
        return text or "another migrator"
    pid, namespace, command = found.groups()
    if namespace == pid_namespace():
        return f"pid {pid}: {command}"
    return f"{command}, in another pid namespace or on another host"


def release(folder: Path) -> None:
    key = _key(folder)
    entry = _HELD.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] <= 0:
        del _HELD[key]
        os.close(entry[0])


@contextlib.contextmanager
def holding(folder: Path, what: str, wait_s: float = 0.0):
    hold(folder, what, wait_s)
    try:
        yield
    finally:
        release(folder)


@contextlib.contextmanager
def released_at_end():
    """Locks taken inside (e.g. by the node that names the recipe folder) are released when it ends."""
    before = {key: entry[1] for key, entry in _HELD.items()}
    try:
        yield
    finally:
        for key in list(_HELD):
            extra = _HELD[key][1] - before.get(key, 0)
            for _ in range(max(0, extra)):
                release(Path(key))
