"""Progress on stderr: each step with its elapsed time and, during a trial run, a live counter of the
tokens generated out of those expected, read from the rank log as it grows.

On a terminal it is rich's live display (spinner, elapsed time, a bar for the counter); anywhere else
plain lines that a log keeps and grep finds, with no escape codes:

    [migrator] vendor ...
    [migrator] vendor done in 1.2s
    [migrator] trial run trial0: formal call 16/16 tokens
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

PREFIX = "[migrator]"
POLL_S = 0.25


def is_live() -> bool:
    """Live display only on a terminal that understands escape codes (not TERM=dumb, not a pipe)."""
    try:
        return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


class _Display:
    """The one rich Progress of the process while a step runs (steps nest: a trial run inside a
    node adds its counter under the node's line)."""

    def __init__(self):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        from rich.text import Text

        class CounterBar(BarColumn):
            """The bar, for a task with a total only (a step has none)."""
            def render(self, task):
                return super().render(task) if task.total is not None else Text("")

        class TokenCount(TextColumn):
            def __init__(self):
                super().__init__("")

            def render(self, task):
                return Text("" if task.total is None else f"{int(task.completed)}/{int(task.total)} tokens")

        self.console = Console(file=sys.stderr, force_terminal=True)
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), CounterBar(bar_width=24),
                                 TokenCount(), TimeElapsedColumn(), console=self.console, transient=True,
                                 refresh_per_second=8, redirect_stdout=False)   # stdout may be --json for a pipe
        self.depth = 0

    def add(self, description: str, total: float | None = None):
        if self.depth == 0:
            self.progress.start()
        self.depth += 1
        return self.progress.add_task(description, total=total)

    def remove(self, task) -> None:
        self.progress.remove_task(task)
        self.depth -= 1
        if self.depth == 0:
            self.progress.stop()

    def print(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False)


_display: _Display | None = None
_lock = threading.Lock()


def _get_display() -> _Display:
    global _display
    with _lock:
        # While it is live, sys.stderr is rich's proxy for it: the display in use is kept.
        if _display is None or (not _display.depth and _display.console.file is not sys.stderr):
            _display = _Display()
        return _display


def say(line: str) -> None:
    """One progress line: above the live display on a terminal, a plain line otherwise."""
    if is_live() and _display is not None and _display.depth:
        _display.print(line)
    else:
        print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def step(name: str) -> Iterator[None]:
    """A step's start, end and elapsed time ("[migrator] NAME done in S.Ss"); on a terminal its line
    ticks live while it runs. A step that raises prints no done line."""
    start = time.perf_counter()
    if not is_live():
        print(f"{PREFIX} {name} ...", file=sys.stderr, flush=True)
        yield
        print(f"{PREFIX} {name} done in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
        return
    display = _get_display()
    task = display.add(name)
    try:
        yield
    finally:
        display.remove(task)
    display.print(f"{PREFIX} {name} done in {time.perf_counter() - start:.1f}s")


# ---------------------------------------------------------------------------------------------
# the token counter of a trial run
# ---------------------------------------------------------------------------------------------


@dataclass
class Call:
    """One generate call seen in the rank log."""
    warmup: bool
    tokens: int = 1          # the prefill gives the first token
    done: bool = False       # its "Request N: outputs:" line was logged
    decoded: bool = False


@dataclass
class RankLogCounter:
    """Tokens generated per generate call, from log_0.log read incrementally as the run writes it.

    `locate()` gives the log folder once the run has made it (None before). One line of the log is
    one token: the prefill line gives the first, each decode line one more (this tool's engine,
    upstream's ModelRunner and the framework's scheduler all log one timing line per step)."""
    locate: Callable[[], Path | None]
    calls: list[Call] = field(default_factory=list)
    path: Path | None = None
    offset: int = 0
    partial: str = ""
    in_warmup: bool = False

    def poll(self) -> None:
        if self.path is None:
            folder = self.locate()
            if folder is None or not (folder / "log_0.log").is_file():
                return
            self.path = folder / "log_0.log"
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return
        self.offset += len(chunk)
        lines = (self.partial + chunk.decode("utf-8", errors="replace")).split("\n")
        self.partial = lines.pop()
        for line in lines:
            self.feed(line.rstrip("\r"))

    def feed(self, line: str) -> None:
        from agent.measure import run_log

        fmt, m = run_log.match_line(line)
        if fmt is None:
            return
        current = self.calls[-1] if self.calls else None
        if fmt.kind == "warmup":
            self.in_warmup = m.group("edge") == "begins"
        elif fmt.kind == "time" and m.group("stage") == "decode":
            if current is not None and not current.done:
                current.tokens += 1
                current.decoded = True
        elif fmt.kind == "time":
            # The framework logs a prefill line per prefill batch of one call: the first starts it.
            if current is None or current.done or current.decoded or fmt.style != "executor":
                self.calls.append(Call(self.in_warmup))
        elif fmt.kind == "output" and current is not None:
            current.done = True


def _call_name(call: Call) -> str:
    return "warm-up call" if call.warmup else "formal call"


@contextlib.contextmanager
def trial_run_counter(label: str, locate: Callable[[], Path | None], expected: int | None) -> Iterator[None]:
    """While the block runs (the trial run's subprocess), count the tokens its rank log shows: live
    under the current step on a terminal; otherwise a plain line per finished generate call and one
    for a call the run left unfinished."""
    counter = RankLogCounter(locate)
    stop = threading.Event()
    live = is_live()
    reported = 0

    def report_finished() -> None:
        nonlocal reported
        for call in counter.calls[reported:]:
            if not call.done:
                break
            say(f"{PREFIX} trial run {label}: {_call_name(call)} {call.tokens}/{expected or '?'} tokens")
            reported += 1

    if live:
        display = _get_display()
        task = display.add(f"trial run {label}: waiting for log_0.log", total=expected)

        def show() -> None:
            report_finished()
            if counter.calls:
                call = counter.calls[-1]
                display.progress.update(task, description=f"trial run {label}: {_call_name(call)}",
                                        completed=call.tokens)
    else:
        def show() -> None:
            report_finished()

    def watch() -> None:
        while not stop.wait(POLL_S):
            counter.poll()
            show()

    thread = threading.Thread(target=watch, name=f"trial-run-{label}-counter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        counter.poll()
        if live:
            display.remove(task)
        report_finished()
        if counter.calls and not counter.calls[-1].done:
            call = counter.calls[-1]
            say(f"{PREFIX} trial run {label}: {_call_name(call)} {call.tokens}/{expected or '?'} tokens (unfinished)")
