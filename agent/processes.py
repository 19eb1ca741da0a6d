"""Subprocesses the migrator starts (a recipe's infer.sh with its torchrun ranks, the parity check),
run as one process tree it owns (psutil).

- Each command starts in its own session (process group), so a Ctrl-C at the terminal reaches the
  migrator alone and the migrator decides: on a timeout, SIGINT or SIGTERM the *whole tree* is
  stopped — bash, torchrun, every rank, and what upstream's launch started with `&` and `wait` —
  SIGTERM first, SIGKILL after a grace period. Descendants are found through the process group and
  psutil's children, and, on Linux, the migrator is a child subreaper, so a rank orphaned by a dying
  bash is still its descendant.
- While it runs, the tree is sampled: the peak of the summed RSS of all its processes is recorded
  beside the run's time (`peak_rss_bytes`).
- The tree gets a temporary folder of its own (TMPDIR, TMP, TEMP), removed when the tree ends however it
  ends (a stopped parity check leaves no `parity_*` copy of the checkpoint's config and tokenizer, a
  stopped stand-in run no record folder); torch's compile cache keeps its usual place. Every temporary
  folder the migrator makes is an owned one (`owned_temp`): its owner holds an flock on a lock file
  inside it for the folder's life, and the kernel drops that lock when the owner dies, even on SIGKILL.
  So the next command that starts a tree in the same temporary folder removes exactly the folders whose
  lock it can take (`remove_orphaned_temp`) — whatever pid namespace or host (a shared filesystem) the
  owner ran in; a pid is never looked at.
- The tree's pids are written to a file while it runs, with the pid namespace they are seen in: a
  migrator killed with SIGKILL cannot stop its tree, so the next run of the same recipe stops what is
  left (`stop_leftovers`) — only from that same pid namespace, and only while it holds the recipe's
  folder lock (agent.folder_lock), which the tree's owner held until it died.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from agent.host import pid_namespace
from agent.paths import OUTER_TMP_ENV, outer_tempdir
from engine.safe_load import load_json
from engine.safe_write import UserTree

GRACE_S = 5.0          # SIGTERM -> SIGKILL
SAMPLE_S = 0.2
# migrator-<what>-<mkdtemp's 8 characters>/: a temporary folder a migrator process owns (owned_temp); one of
# an earlier release is named migrator-<pid>-<start ms>-<what>-<8 characters>/ and has no lock
_OWNED_TEMP = re.compile(r"\.?migrator-(?:\d+-\d+-)?[a-z_]+-[a-z0-9_]{8}")
OWNER_LOCK = "owner.lock"     # in an owned folder: flocked by its owner for the folder's life
WORK = "work"                 # in an owned folder: what the owner uses
# An owned folder without its lock file (one of an earlier release, or one whose owner died in the
# microseconds between making it and locking it) is removed only once it is this old.
UNLOCKED_TEMP_AGE_S = 24 * 3600


class Terminated(BaseException):
    """SIGTERM reached the migrator (raised in the main thread like KeyboardInterrupt for SIGINT)."""


@dataclass
class TreeResult:
    returncode: int | None
    timed_out: bool
    seconds: float
    peak_rss_bytes: int
    processes: int          # how many distinct processes the tree had


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process, not to init (Linux; elsewhere a no-op)."""
    if sys.platform != "linux":
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)     # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _tree(root: psutil.Process, pgid: int, known: dict[int, float]) -> list[psutil.Process]:
    """The live processes of the tree: root's descendants, the process group, and pids seen before
    (checked against their start time, so a reused pid is never touched)."""
    found: dict[int, psutil.Process] = {}
    try:
        found[root.pid] = root
        for child in root.children(recursive=True):
            found[child.pid] = child
    except psutil.Error:
        pass
    for pid, started in list(known.items()):
        if pid in found:
            continue
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - started) < 0.01:
                found[pid] = proc
        except psutil.Error:
            continue
    for proc in psutil.process_iter(["pid"]):
        if proc.pid not in found and _in_group(proc, pgid):
            found[proc.pid] = proc
    return list(found.values())


def stop_tree(processes: list[psutil.Process], grace: float = GRACE_S) -> None:
    """SIGTERM every process, SIGKILL what is still alive after `grace` seconds; reap zombies."""
    for proc in processes:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace)


def _reap() -> None:
    """Collect exited orphans re-parented to us (a subreaper's duty), never blocking."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def run_tree(command: list[str], *, cwd: Path, env: dict, stdout, timeout: float | None,
             pids_file: Path | None = None, pids_root: Path | None = None, stderr=subprocess.STDOUT,
             stdin=subprocess.DEVNULL, dies_with_caller: bool = False) -> TreeResult:
    """Run `command` as a process tree (see the module docs). On a timeout the tree is stopped and
    returncode is None; on KeyboardInterrupt / Terminated the tree is stopped and the exception goes on.
    `dies_with_caller`: the command gets SIGTERM when this process dies, even by SIGKILL (Linux; the caller
    must start no threads: it is set between fork and exec) — for a command that is the user's own
    (`migrator standin -- migrator run …`), which must not run on unseen once the user killed the one they
    started.
    `pids_file`: where the tree's pids are kept while it runs, written in the tree `pids_root` (the
    recipe it lies in)."""
    if pids_file is not None and pids_root is None:
        raise TypeError("run_tree: a pids_file needs its pids_root (the recipe it is written in)")
    from agent import folder_lock

    become_subreaper()
    remove_orphaned_temp()
    # the recipe's folder lock for the tree's life: whoever finds its pids file while the lock is free
    # knows this process is gone (stop_leftovers)
    with owned_temp("tree") as private_tmp, \
            folder_lock.holding(pids_root, "run it") if pids_file is not None else contextlib.nullcontext():
        pids_tree = None if pids_file is None else _pids_tree(pids_root)
        return _run_tree(command, cwd, _with_private_tmp(env, private_tmp), stdout, timeout, pids_tree, pids_file,
                         stderr, stdin, _term_when_parent_dies() if dies_with_caller else None)


@contextlib.contextmanager
def owned_temp(what: str, dir: Path | None = None, hidden: bool = False):
    """A temporary folder of this process, yielded as a path and removed at the end of the block however
    it ends. It is made as `migrator-<what>-<random>/` holding `owner.lock`, which this process flocks for
    the folder's life, and `work/`, the folder yielded (so nothing the caller copies or lists sees the
    lock). The lock file appears only once it is held (locked under a temporary name, then renamed), so a
    cleaner never meets the unheld lock of a live owner; a SIGKILLed owner's lock is free at once, on
    any host that shares the filesystem and in any pid namespace (remove_orphaned_temp). `hidden`: named
    `.migrator-…` (made in a folder whose other entries a tool lists, e.g. a checkout's models/)."""
    if not re.fullmatch(r"[a-z_]+", what):
        raise ValueError(f"owned_temp: {what!r} is not a lower-case word")
    folder = Path(tempfile.mkdtemp(prefix=f"{'.' if hidden else ''}migrator-{what}-", dir=dir))
    fd = None
    try:
        fd = _hold_owner_lock(folder)
        work = folder / WORK
        work.mkdir(mode=0o700)
        yield work
    finally:
        shutil.rmtree(folder, ignore_errors=True)     # while the lock is held: no cleaner takes it meanwhile
        if fd is not None:
            os.close(fd)


def _hold_owner_lock(folder: Path) -> int | None:
    """flock a new file in `folder` and give it its name (OWNER_LOCK) only then; the descriptor (not
    inherited by children: PEP 446) is the lock. None where the filesystem has no flock: the folder then
    counts as one without a lock (removed only once old)."""
    pending = folder / f".{OWNER_LOCK}.{os.urandom(4).hex()}"
    fd = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    os.rename(pending, folder / OWNER_LOCK)
    return fd


def remove_orphaned_temp(folder: Path | None = None, *, unlocked_age_s: float = UNLOCKED_TEMP_AGE_S) -> list[Path]:
    """Remove the owned temporary folders (owned_temp) in `folder` (default: the temporary folder) whose
    owner is gone: those whose owner lock this process can take. One without a lock file (half-made, or
    of an earlier release) goes only when older than `unlocked_age_s`. Only the user's own plain folders
    are touched, never through a link. Returns what was removed."""
    root = Path(folder or tempfile.gettempdir())
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not _OWNED_TEMP.fullmatch(entry.name):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if not entry.is_dir(follow_symlinks=False) or info.st_uid != os.getuid():
                continue
        except OSError:
            continue
        path = Path(entry.path)
        try:
            fd = os.open(path / OWNER_LOCK, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            if time.time() - info.st_mtime > unlocked_age_s:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            continue
        except OSError:        # a link in the lock's place, no permission: not a folder to judge
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:        # held: its owner lives, here or anywhere (ENOLCK and the like: kept too)
            os.close(fd)
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)       # the owner is gone; held meanwhile
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def _with_private_tmp(env: dict, folder: Path) -> dict:
    """The tree's environment with its temporary folder; torch inductor's cache stays where it is by
    default (a folder under the real temporary folder), so compiled graphs are reused across runs."""
    env = dict(os.environ if env is None else env)
    if "TORCHINDUCTOR_CACHE_DIR" not in env:
        import getpass

        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = str(os.getuid())
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(outer_tempdir(), f"torchinductor_{user}")
    env.setdefault(OUTER_TMP_ENV, str(outer_tempdir()))     # where a child migrator's crash report goes
    for name in ("TMPDIR", "TMP", "TEMP"):
        env[name] = str(folder)
    return env


def _pids_tree(root: Path) -> UserTree:
    return UserTree(root, "the recipe")


def _term_when_parent_dies():
    """What the child runs before exec to get SIGTERM when its parent dies (PR_SET_PDEATHSIG), resolved here
    before the fork; None off Linux, or where another thread runs (a child forked beside a thread may only
    exec)."""
    if sys.platform != "linux" or threading.active_count() > 1:
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    term = int(signal.SIGTERM)
    return lambda: prctl(1, term, 0, 0, 0)       # 1: PR_SET_PDEATHSIG


def _run_tree(command, cwd, env, stdout, timeout, pids_tree, pids_file, stderr, stdin, preexec=None) -> TreeResult:
    start = time.perf_counter()
    proc = None
    known: dict[int, float] = {}
    peak = 0
    deadline = None if timeout is None else start + timeout
    timed_out = False
    try:
        with signals_held():      # a signal while Popen forks is taken once `proc` is known, so the tree is stopped
            proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                                    preexec_fn=preexec,
                                    start_new_session=True)
        root = psutil.Process(proc.pid)
        pgid = proc.pid
        while True:
            members = _tree(root, pgid, known)
            rss = 0
            for member in members:
                try:
                    known.setdefault(member.pid, member.create_time())
                    rss += member.memory_info().rss
                except psutil.Error:
                    continue
            peak = max(peak, rss)
            if pids_tree is not None:
                _write_pids(pids_tree, pids_file, pgid, known)
            if proc.poll() is not None:
                # the launcher exited: anything it left behind (a rank started with `&`) is stopped too
                leftovers = [p for p in _tree(root, pgid, known) if p.pid != proc.pid and _alive(p)]
                if leftovers:
                    stop_tree(leftovers)
                break
            if deadline is not None and time.perf_counter() >= deadline:
                timed_out = True
                stop_tree(_tree(root, pgid, known))
                proc.wait()
                break
            try:
                proc.wait(timeout=SAMPLE_S)
            except subprocess.TimeoutExpired:
                pass
    except BaseException:
        if proc is not None:
            stop_tree(_started_tree(proc, known))
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        raise
    finally:
        if pids_tree is not None:
            pids_tree.unlink(pids_file)
    _reap()
    return TreeResult(None if timed_out else proc.returncode, timed_out, round(time.perf_counter() - start, 2),
                      peak, len(known))


def _started_tree(proc: subprocess.Popen, known: dict[int, float]) -> list[psutil.Process]:
    try:
        return _tree(psutil.Process(proc.pid), proc.pid, known)
    except psutil.Error:      # the root is gone and reaped: what is left is in its process group
        return [p for p in psutil.process_iter(["pid"]) if _in_group(p, proc.pid)]


def _in_group(proc: psutil.Process, pgid: int) -> bool:
    try:
        return os.getpgid(proc.pid) == pgid
    except (OSError, psutil.Error):
        return False


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _write_pids(tree: UserTree, path: Path, pgid: int, known: dict[int, float]) -> None:
    data = json.dumps({"pgid": pgid, "pids": {str(k): v for k, v in sorted(known.items())},
                       "pid_namespace": pid_namespace()}).encode()
    try:
        tree.write_bytes(path, data)
    except OSError:
        pass



def stop_leftovers(pids_file: Path, root: Path) -> int:
    """A tree a killed migrator left running (its pids file survived): stop the processes that are still
    the ones recorded (same pid and start time), when they were recorded in this pid namespace; from another
    (another container, CI job or host) nothing can be told by their pids, so that is said in one line and
    they are left alone. Taken under the folder lock of `root` (the recipe the pids file lies in), which the
    tree's owner held for the tree's life (run_tree): free means the owner is gone, whatever namespace it
    ran in; another live holder is refused (exit 75) and its tree left alone. Returns how many were stopped."""
    from agent import folder_lock

    if not os.path.lexists(pids_file):
        return 0
    with folder_lock.holding(root, "run it"):
        try:
            data = load_json(pids_file)
            pids = {int(k): float(v) for k, v in data["pids"].items()}
            recorded_in = data.get("pid_namespace")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            _pids_tree(root).unlink(pids_file)
            return 0
        here = pid_namespace()
        if pids and (here is None or recorded_in != here):
            where = "an unknown pid namespace (a pids file of an earlier release)" if not isinstance(recorded_in, str) \
                else "another pid namespace or host"
            print(f"[migrator] {pids_file}: the {len(pids)} process(es) a killed migrator's tree left were recorded "
                  f"in {where}; they cannot be told apart by pid from here and are left alone: stop them where "
                  "they run", file=sys.stderr)
            _pids_tree(root).unlink(pids_file)
            return 0
        alive = []
        for pid, started in pids.items():
            try:
                proc = psutil.Process(pid)
                if abs(proc.create_time() - started) < 0.01 and _alive(proc):
                    alive.append(proc)
            except psutil.Error:
                continue
        if alive:
            stop_tree(alive)
        _pids_tree(root).unlink(pids_file)
        return len(alive)


def install_signal_handlers() -> None:
    """SIGTERM raises Terminated in the main thread (so the running tree is stopped and the CLI
    prints one line); after the first SIGINT or SIGTERM further ones are ignored while the migrator
    cleans up, so a second Ctrl-C never interrupts the cleanup (no atexit traceback)."""
    def on_term(signum, frame):
        _ignore_more()
        raise Terminated()

    def on_int(signum, frame):
        _ignore_more()
        raise KeyboardInterrupt()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_int)


@contextlib.contextmanager
def signals_held():
    """SIGINT and SIGTERM that arrive inside the block are delivered when it ends, to the handlers that
    were there before (the main thread only: elsewhere Python takes no signals). The block is short and
    must not be interrupted halfway: a process forked but not yet known to its caller cannot be stopped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    for signum in before:
        signal.signal(signum, lambda got, frame: held.append(got))
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(held):
            signal.raise_signal(signum)     # the handler before (raises Terminated / KeyboardInterrupt)


def _ignore_more() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
