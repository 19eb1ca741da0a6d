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
