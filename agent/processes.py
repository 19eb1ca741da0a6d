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
  stopped stand-in run no record folder); torch's compile cache keeps its usual place. Its name
  carries the owner's pid and start time (`owned_temp_prefix`): a migrator killed with SIGKILL cannot
  remove it, so the next tree started in the same temporary folder removes every such folder whose
  owner is gone (`remove_orphaned_temp`).
- The tree's pids are written to a file while it runs: a migrator killed with SIGKILL cannot stop
  its tree, so the next run of the same recipe stops what is left (`stop_leftovers`).
"""

from __future__ import annotations

import contextlib
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
from engine.safe_load import load_json
from engine.safe_write import UserTree

GRACE_S = 5.0          # SIGTERM -> SIGKILL
SAMPLE_S = 0.2
OUTER_TMP_ENV = "MIGRATOR_OUTER_TMPDIR"   # the temporary folder outside every tree's own
# migrator-<owner pid>-<owner start time, ms>-<what>-<random>: a temporary folder a migrator process owns
_OWNED_TEMP = re.compile(r"^migrator-(\d+)-(\d+)-[a-z_]+-")


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
             stdin=subprocess.DEVNULL) -> TreeResult:
    """Run `command` as a process tree (see the module docs). On a timeout the tree is stopped and
    returncode is None; on KeyboardInterrupt / Terminated the tree is stopped and the exception goes on.
    `pids_file`: where the tree's pids are kept while it runs, written in the tree `pids_root` (the
    recipe it lies in)."""
    if pids_file is not None and pids_root is None:
        raise TypeError("run_tree: a pids_file needs its pids_root (the recipe it is written in)")
    become_subreaper()
    remove_orphaned_temp()
    private_tmp = Path(tempfile.mkdtemp(prefix=owned_temp_prefix("tree")))
    try:
        pids_tree = None if pids_file is None else _pids_tree(pids_root)
        return _run_tree(command, cwd, _with_private_tmp(env, private_tmp), stdout, timeout, pids_tree, pids_file,
                         stderr, stdin)
    finally:
        shutil.rmtree(private_tmp, ignore_errors=True)


def _started_ms(pid: int) -> int | None:
    try:
        return int(psutil.Process(pid).create_time() * 1000)
    except psutil.Error:
        return None


def owned_temp_prefix(what: str) -> str:
    """A prefix for a temporary folder of this process (tempfile.mkdtemp / TemporaryDirectory): its name
    says whose it is, so one a SIGKILL left behind is recognised as orphaned (remove_orphaned_temp)."""
    return f"migrator-{os.getpid()}-{_started_ms(os.getpid()) or 0}-{what}-"


def remove_orphaned_temp(folder: Path | None = None) -> list[Path]:
    """Remove the owned temporary folders (owned_temp_prefix) in `folder` (default: the temporary folder)
    whose owner process is gone, or whose pid now names another process (its start time differs).
    Only the user's own plain folders are touched, never through a link. Returns what was removed."""
    root = Path(folder or tempfile.gettempdir())
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        match = _OWNED_TEMP.match(entry.name)
        if not match:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        pid, started = int(match.group(1)), int(match.group(2))
        now = _started_ms(pid)
        if now is not None and (started == 0 or abs(now - started) <= 10):
            continue            # its owner runs (a start time it could not read: the pid alone decides)
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
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
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    env.setdefault(OUTER_TMP_ENV, tempfile.gettempdir())     # where a child migrator's crash report goes
    for name in ("TMPDIR", "TMP", "TEMP"):
        env[name] = str(folder)
    return env


def _pids_tree(root: Path) -> UserTree:
    return UserTree(root, "the recipe")


def _run_tree(command, cwd, env, stdout, timeout, pids_tree, pids_file, stderr, stdin) -> TreeResult:
    start = time.perf_counter()
    proc = None
    known: dict[int, float] = {}
    peak = 0
    deadline = None if timeout is None else start + timeout
    timed_out = False
    try:
        with signals_held():      # a signal while Popen forks is taken once `proc` is known, so the tree is stopped
            proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
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
    data = json.dumps({"pgid": pgid, "pids": {str(k): v for k, v in sorted(known.items())}}).encode()
    try:
        tree.write_bytes(path, data)
    except OSError:
        pass



def stop_leftovers(pids_file: Path, root: Path) -> int:
    """A tree a killed migrator left running (its pids file survived): stop the processes that are
    still the ones recorded (same pid and start time). Returns how many were stopped. `root`: the
    recipe the pids file lies in (its removal is anchored there)."""
    try:
        data = load_json(pids_file)
        pids = {int(k): float(v) for k, v in data["pids"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
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
