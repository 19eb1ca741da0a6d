"""agent.processes: a signal that reaches the migrator at any point after its command was forked stops
the command's tree (in-process; the e2e signal matrix is tests/e2e/test_command_signals.py)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from agent import processes


@pytest.fixture
def migrator_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    processes.install_signal_handlers()
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("signum, raised", [(signal.SIGTERM, processes.Terminated),
                                            (signal.SIGINT, KeyboardInterrupt)])
def test_a_signal_while_the_command_is_being_started_stops_it(tmp_path, monkeypatch, migrator_handlers,
                                                              signum, raised):
    """The window CI met: the command ran (it had forked and exec'd) but Popen had not returned yet; the
    exception left _run_tree before it knew the process, and the tree ran on holding the caller's pipes."""
    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def popen_then_signal(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        signal.raise_signal(signum)      # inside Popen, as far as the caller can tell
        return proc

    monkeypatch.setattr(processes.subprocess, "Popen", popen_then_signal)
    try:
        with pytest.raises(raised):
            processes.run_tree([sys.executable, "-c", "import time; time.sleep(30)"], cwd=tmp_path, env=None,
                               stdout=subprocess.DEVNULL, timeout=60)
        assert len(started) == 1
        assert started[0].poll() is not None, "the command runs on after the signal"
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_signals_held_delivers_each_signal_once_after_the_block(migrator_handlers):
    ran = []
    with pytest.raises(processes.Terminated):
        with processes.signals_held():
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)
            ran.append("the block ran to its end")
    assert ran == ["the block ran to its end"]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN      # the migrator's handler ran: later ones ignored


def test_signals_held_changes_nothing_when_no_signal_came(migrator_handlers):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with processes.signals_held():
        pass
    assert {s: signal.getsignal(s) for s in before} == before


# ---- owned temporary folders: the owner's lock decides, never a pid --------------------------------
HOLD = ("import sys, time\nfrom pathlib import Path\nfrom agent.processes import owned_temp\n"
        "with owned_temp(sys.argv[2], Path(sys.argv[1])) as work:\n"
        "    (work / 'config.json').write_text('{}')\n    print(work, flush=True)\n    time.sleep(600)\n")
CLEAN = ("import sys\nfrom pathlib import Path\nfrom agent.processes import remove_orphaned_temp\n"
         "print(' '.join(sorted(p.name for p in remove_orphaned_temp(Path(sys.argv[1])))))\n")


def _python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


def _env(tag: str = "") -> dict:
    import os

    from locations import REPO_ROOT

    return dict(os.environ, PYTHONPATH=str(REPO_ROOT), FIELD_TAG=tag)


def _holder(folder, command: list[str], tag: str) -> tuple[subprocess.Popen, "Path"]:
    from pathlib import Path

    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tag),
                            start_new_session=True)
    line = proc.stdout.readline().strip()
    assert line, proc.communicate(timeout=30)[1][-2000:]
    return proc, Path(line).parent


def _kill_tagged(tag: str, proc: subprocess.Popen) -> None:
    import os

    from process_tags import _tagged

    for pid in _tagged(tag):
        os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=60)


@pytest.mark.parametrize("holder_ns, cleaner_ns", [("other", "this"), ("this", "other"), ("other", "other")])
def test_a_live_owned_folder_is_kept_by_a_cleaner_in_any_pid_namespace_and_removed_once_its_owner_died(
        tmp_path, holder_ns, cleaner_ns):
    """Newcomer F2/F2b: a cleaner judged a folder by its owner's pid as seen from its own pid namespace and
    removed live migrators' folders across namespaces, both ways. Now the owner's flock decides."""
    import uuid

    from pid_namespace import in_other_pid_namespace

    def where(command, ns):
        return in_other_pid_namespace(command) if ns == "other" else command

    tag = uuid.uuid4().hex
    proc, folder = _holder(tmp_path, where(_python(HOLD, str(tmp_path), "precision"), holder_ns), tag)
    try:
        assert folder.name.startswith("migrator-precision-") and (folder / "owner.lock").is_file()
        cleaned = subprocess.run(where(_python(CLEAN, str(tmp_path)), cleaner_ns), capture_output=True, text=True,
                                 env=_env(), timeout=60)
        assert cleaned.returncode == 0 and cleaned.stdout.strip() == "", cleaned.stdout + cleaned.stderr
        assert (folder / "work" / "config.json").is_file()
    finally:
        _kill_tagged(tag, proc)           # SIGKILL: the owner cannot remove its folder
    assert folder.is_dir()
    cleaned = subprocess.run(where(_python(CLEAN, str(tmp_path)), cleaner_ns), capture_output=True, text=True,
                             env=_env(), timeout=60)
    assert cleaned.stdout.split() == [folder.name], cleaned.stdout + cleaned.stderr
    assert not folder.exists()


def test_owned_temp_is_locked_for_its_life_and_gone_after(tmp_path):
    import fcntl
    import os

    with processes.owned_temp("tree", tmp_path) as work:
        folder = work.parent
        assert work.name == "work" and work.is_dir() and not any(work.iterdir())   # the caller's folder is empty
        assert sorted(p.name for p in folder.iterdir()) == ["owner.lock", "work"]   # no half-named lock left
        fd = os.open(folder / "owner.lock", os.O_RDONLY)
        try:      # another open file description: refused while the owner lives (as another process would be)
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        assert processes.remove_orphaned_temp(tmp_path) == []
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError):
        with processes.owned_temp("../x", tmp_path):
            pass


def test_folders_without_a_lock_go_only_when_old_and_nothing_else_is_touched(tmp_path):
    """A folder whose owner died between making it and locking it, or one of an earlier release (named by a
    pid, which says nothing here): kept while young, removed once old. Links, files, other names: never."""
    import os
    import time

    young_half_made = tmp_path / "migrator-tree-a1b2c3d4"
    old_half_made = tmp_path / "migrator-precision-e5f6g7h8"
    old_earlier_release = tmp_path / f"migrator-{os.getpid()}-1700000000000-revendor-c3c3c3c3"   # a live pid: not asked
    young_earlier_release = tmp_path / "migrator-1-1700000000000-tree-c4c4c4c4"
    lock_is_a_link = tmp_path / "migrator-tree-linked00"
    victim = tmp_path / "victim"
    for folder in (young_half_made, old_half_made, old_earlier_release, young_earlier_release, lock_is_a_link, victim):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    (lock_is_a_link / "owner.lock").symlink_to(victim / "config.json")
    (young_half_made / ".owner.lock.0badf00d").write_text("")          # locked under its pending name, then killed
    long_ago = time.time() - processes.UNLOCKED_TEMP_AGE_S - 60
    for folder in (old_half_made, old_earlier_release, lock_is_a_link):
        os.utime(folder, (long_ago, long_ago))
    (tmp_path / "migrator-tree-alink000").symlink_to(victim, target_is_directory=True)
    (tmp_path / "migrator-tree-afile000").write_text("x")
    (tmp_path / "migrator-crash-x.txt").write_text("x")
    (tmp_path / "parity_123").mkdir()
    (tmp_path / "migrator-checkout-2e73d321b8cd").mkdir()       # tests/conftest.py's links: not an owned folder
    os.utime(tmp_path / "migrator-checkout-2e73d321b8cd", (long_ago, long_ago))
    removed = processes.remove_orphaned_temp(tmp_path)
    assert sorted(p.name for p in removed) == sorted([old_half_made.name, old_earlier_release.name])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([
        young_half_made.name, young_earlier_release.name, lock_is_a_link.name, "victim", "migrator-tree-alink000",
        "migrator-tree-afile000", "migrator-crash-x.txt", "parity_123", "migrator-checkout-2e73d321b8cd"])
    assert (victim / "config.json").is_file()


# ---- the pids file of a tree a killed migrator left: stopped from its own pid namespace only ---------------
def _sleeper(tag: str = "") -> subprocess.Popen:
    return subprocess.Popen(["sleep", "600"], start_new_session=True, env=_env(tag))


def _pids_file(root, proc: subprocess.Popen, namespace) -> "Path":
    import json

    import psutil

    path = root / ".migrator" / "runs" / "running.pids"
    path.parent.mkdir(parents=True)
    record = {"pgid": proc.pid, "pids": {str(proc.pid): psutil.Process(proc.pid).create_time()}}
    if namespace != "absent":
        record["pid_namespace"] = namespace
    path.write_text(json.dumps(record))
    return path


def _other_namespace() -> str:
    from pid_namespace import in_other_pid_namespace

    code = "from agent.processes import pid_namespace; print(pid_namespace())"
    got = subprocess.run(in_other_pid_namespace([sys.executable, "-c", code]), capture_output=True, text=True,
                         env=_env(), timeout=60)
    assert got.returncode == 0 and got.stdout.strip() not in ("", "None"), got.stderr
    return got.stdout.strip()


def test_leftovers_recorded_in_this_pid_namespace_are_stopped(tmp_path):
    proc = _sleeper()
    try:
        path = _pids_file(tmp_path, proc, processes.pid_namespace())
        assert processes.stop_leftovers(path, tmp_path) == 1
        assert proc.wait(timeout=30) is not None and not path.exists()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("recorded_in", ["another_namespace", "absent"])
def test_leftovers_recorded_elsewhere_are_left_alone_with_one_line(tmp_path, capsys, recorded_in):
    """A pid recorded in another pid namespace (a container, a CI job, another host on a shared filesystem)
    names another process here, even with the same start time: this live process stands for that collision."""
    assert processes.pid_namespace() is not None
    namespace = _other_namespace() if recorded_in == "another_namespace" else "absent"
    assert namespace != processes.pid_namespace()
    proc = _sleeper()
    try:
        path = _pids_file(tmp_path, proc, namespace)
        assert processes.stop_leftovers(path, tmp_path) == 0
        assert proc.poll() is None, "a process of this namespace was stopped for a pid recorded elsewhere"
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "left alone" in lines[0] and str(path) in lines[0], lines
        assert ("earlier release" in lines[0]) == (recorded_in == "absent")
    finally:
        proc.kill()
        proc.wait()


def test_a_tree_left_in_another_pid_namespace_is_not_stopped_from_here(tmp_path, capsys):
    """The real thing: a migrator in another pid namespace runs a tree with its pids file in the recipe and is
    SIGKILLed; its namespace lives on (its pid 1 is a shell), so its tree does too. The next run here cannot
    tell those pids apart: it says so and stops nothing."""
    import time
    import uuid

    import psutil

    from pid_namespace import in_other_pid_namespace
    from process_tags import _tagged

    tag, pids = uuid.uuid4().hex, tmp_path / "runs" / "running.pids"
    pids.parent.mkdir()
    code = ("import subprocess, sys\nfrom pathlib import Path\nfrom agent.processes import run_tree\n"
            f"run_tree(['sleep', '600'], cwd=Path({str(tmp_path)!r}), env=None, stdout=subprocess.DEVNULL, "
            f"timeout=None, pids_file=Path({str(pids)!r}), pids_root=Path({str(tmp_path)!r}))\n")
    shell = subprocess.Popen(in_other_pid_namespace(["sh", "-c", f'{sys.executable} -c "$0" & wait; sleep 600', code]),
                             env=_env(tag), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not pids.exists():
            assert time.monotonic() < deadline and shell.poll() is None, "the tree never wrote its pids"
            time.sleep(0.1)
        migrator = [p for p in _tagged(tag) if psutil.Process(p).cmdline()[:2] == [sys.executable, "-c"]]
        assert len(migrator) == 1
        os_kill(migrator[0])
        time.sleep(0.5)
        sleepers = [p for p in _tagged(tag) if psutil.Process(p).cmdline() == ["sleep", "600"]]
        assert sleepers, "the killed migrator's tree should run on in its namespace"
        assert processes.stop_leftovers(pids, tmp_path) == 0
        assert "another pid namespace or host" in capsys.readouterr().err
        assert all(psutil.pid_exists(p) for p in sleepers)
    finally:
        for pid in _tagged(tag):
            os_kill(pid)
        shell.wait(timeout=30)


def os_kill(pid: int) -> None:
    import os

    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_leftovers_of_a_live_holder_of_the_recipe_are_never_stopped(tmp_path):
    """The pids file of a tree whose owner lives (it holds the recipe's folder lock, in whatever namespace):
    refused with one line (exit 75), nothing stopped."""
    from agent import errors

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
                               "from agent import folder_lock\nfolder_lock.hold(Path(sys.argv[1]), 'run it')\n"
                               "print('held', flush=True)\ntime.sleep(600)\n", str(tmp_path)],
                              stdout=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
    proc = _sleeper()
    try:
        assert holder.stdout.readline().strip() == "held"
        path = _pids_file(tmp_path, proc, processes.pid_namespace())
        with pytest.raises(errors.MigratorError) as refused:
            processes.stop_leftovers(path, tmp_path)
        assert refused.value.exit_code == errors.EXIT_BUSY and "being written by another" in str(refused.value)
        assert proc.poll() is None and path.exists()
    finally:
        for p in (proc, holder):
            p.kill()
            p.wait()
