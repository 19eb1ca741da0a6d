"""Why a child process failed, in one line: the one place a child's failure becomes a reason.

A Python child that dies of an exception prints a traceback: the exception line of its last traceback
(the one that ended it, after any causes it chains) is the reason — never its last stderr line, which
may be a progress bar or a warning. Without a traceback, a line the child wrote as its error
(`prog: error: …`, `SomeError: …`); else what the exit status says (a signal, an exit code), and no
text is guessed. Every caller that starts a child and reports its failure goes through `child_failure`
(tests/lint/test_child_failure_reasons.py keeps it so).

The traceback reader (`tracebacks`) is also what agent.repair.failure reads a failed run with.
"""

from __future__ import annotations

import re
import signal

TRACEBACK_START = "Traceback (most recent call last):"
CHAINED_RE = re.compile(r"^(During handling of the above exception|The above exception was the direct cause)")
FRAME_RE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)')
RANK_PREFIX_RE = re.compile(r"^\[rank\d+\]:\s*")
RANK_PREFIXES_RE = re.compile(r"^\[rank\d+\]: ?", re.M)      # torch.distributed's, on every line a rank prints
PROGRESS_RE = re.compile(r"\d+%\||it/s\]|s/it\]|\r")      # a tqdm bar (Loading weights: 100%|███| 38/38 …)
# what follows an exception without being its message: a progress bar, a log line, shutdown's ignored errors
NOT_MESSAGE_RE = re.compile(PROGRESS_RE.pattern + r"|^\[|^(?:INFO|WARNING|ERROR|DEBUG)\b|^Exception ignored|"
                            r"^Traceback \(most recent call last\)|^During handling of|^The above exception")
# what a child writes as its one-line error without a traceback: argparse's `prog: error: …`, pip's
# `ERROR: …`, `SomeError: …`, bash's `script.sh: line N: …`
ERROR_LINE_RE = re.compile(r"^[\w./ -]+: error: \S.*|^(?:[\w.]+\.)?\w*(?:Error|Exception)\b:.*|^error: \S.*|"
                           r"^\S+: line \d+: \S.*", re.I)
MAX_REASON = 300
MESSAGE_LINES = 6          # an exception's message may continue on the lines after its first


def tracebacks(output: str) -> list[tuple[list[tuple[str, int]], str, str | None]]:
    """Every traceback in the output: (frames, exception line, how it chains to the one before:
    "cause" for `raise ... from`, "context" for an error while handling, None for a new one)."""
    lines = output.splitlines()
    blocks = []
    link = None
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = CHAINED_RE.match(line.strip())
        if marker:
            link = "cause" if "direct cause" in line else "context"
            i += 1
            continue
        if TRACEBACK_START not in line:
            if line.strip() and not marker and link and not line.startswith((" ", "\t")):
                link = None     # something else came between: the next traceback is a new error
            i += 1
            continue
        frames: list[tuple[str, int]] = []
        error = ""
        j = i + 1
        while j < len(lines):
            rest = lines[j]
            m = FRAME_RE.match(rest)
            if m:
                frames.append((m.group("file"), int(m.group("line"))))
            elif rest.strip() and not rest.startswith((" ", "\t")):
                # strip a prefix some launchers put before the line ("[rank0]: ValueError: ...")
                error = RANK_PREFIX_RE.sub("", rest.strip())
                break
            j += 1
        blocks.append((frames, error, link))
        link = None
        i = j + 1
    return blocks


def last_exception(output: str) -> str | None:
    """The exception that ended a Python process: the last traceback's exception line with the lines
    its message continues on, one line. Tracebacks Python prints as ignored (`Exception ignored in …`,
    at shutdown) are not it. None without a traceback."""
    lines = RANK_PREFIXES_RE.sub("", output).splitlines()
    starts = [i for i, line in enumerate(lines) if TRACEBACK_START in line
              and not any(lines[k].startswith("Exception ignored") for k in range(max(0, i - 2), i))]
    for start in reversed(starts):
        found = tracebacks("\n".join(lines[start:]))
        if not found or not found[0][1]:
            continue
        error = found[0][1]
        at = next((k for k in range(start + 1, len(lines)) if lines[k].strip() == error), None)
        message = [error]
        for extra in lines[at + 1: at + 1 + MESSAGE_LINES] if at is not None else []:
            if not extra.strip() or NOT_MESSAGE_RE.search(extra):
                break
            message.append(extra.strip())
        return one_line(" ".join(message))
    return None


def is_progress(line: str) -> bool:
    """A progress bar's line: never anyone's reason."""
    return bool(PROGRESS_RE.search(line))


def signal_exit(returncode: int | None) -> str | None:
    """"killed by SIGKILL …" for a process a signal ended (a negative return code), else None."""
    if returncode is None or returncode >= 0:
        return None
    name = _signal_name(-returncode)
    return f"killed by {name}" + (" (out of memory, or stopped by someone)" if name == "SIGKILL" else "")


def one_line(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= MAX_REASON else text[:MAX_REASON - 1] + "…"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def child_failure(stderr: str, returncode: int | None, *, timed_out: bool = False, timeout_s: float | None = None,
                  stdout: str = "", no_answer: str = "it wrote no answer") -> str:
    """One line saying why a child failed (see the module docs). `stderr`/`stdout`: what it printed;
    `returncode`: None while it runs on (a timeout), negative for a signal; `no_answer`: what a child
    that exited 0 without its answer is said to have done (the caller knows where the answer was due)."""
    if timed_out:
        return f"timed out after {timeout_s:g} s" if timeout_s else "timed out"
    text = "\n".join(part for part in (stderr or "", stdout or "") if part)
    exception = last_exception(stderr or "") or last_exception(stdout or "")
    if exception:
        return exception
    if signal_exit(returncode):
        return signal_exit(returncode)
    if returncode == 0:
        return f"exited 0, but {no_answer}"
    said = [line.strip() for line in RANK_PREFIXES_RE.sub("", text).splitlines()]
    errors = [line for line in said if ERROR_LINE_RE.match(line)]
    # the last that says "error" (bash follows its error with the line it failed on), else the last
    error = next((line for line in reversed(errors) if "error" in line.lower()), errors[-1] if errors else None)
    if error:
        return one_line(error)
    code = f"exit code {returncode}" if returncode is not None else "no exit status"
    return f"{code}, no error message"
