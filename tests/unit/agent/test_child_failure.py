"""agent.child_failure: a child's failure is its exception (the last traceback's, chained causes followed,
the message's further lines kept), never its last stderr line (a progress bar, a warning)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agent.child_failure import child_failure, last_exception

TQDM = "Loading weights: 100%|██████████| 38/38 [00:00<00:00, 28532.68it/s]"


def _child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_progress_bar_after_nothing_is_no_reason():
    """F1: the child exited 0 but its answer file was gone; its stderr ends with a tqdm bar."""
    why = child_failure(f"warming up\n{TQDM}\n", 0, no_answer="its verdict is not there")
    assert why == "exited 0, but its verdict is not there"
    assert "Loading weights" not in why


def test_the_exception_of_a_real_child_not_its_last_line():
    proc = _child("import sys\n"
                  "print('Loading weights: 100%|#####| 38/38', file=sys.stderr)\n"
                  "raise ValueError(\"Couldn't instantiate the backend tokenizer from one of: \\n(1) a tokenizers file\\n"
                  "(2) a slow tokenizer\")\n")
    assert proc.returncode == 1
    why = child_failure(proc.stderr, proc.returncode)
    assert why == ("ValueError: Couldn't instantiate the backend tokenizer from one of: (1) a tokenizers file "
                   "(2) a slow tokenizer")


def test_a_warning_or_a_bar_printed_after_the_traceback_is_not_the_reason():
    proc = _child("import atexit, sys\n"
                  "atexit.register(lambda: print('Loading: 100%|###| 3/3 [00:00<00:00, 9.1it/s]', file=sys.stderr))\n"
                  "{}['moe_ep_group']\n")
    assert child_failure(proc.stderr, proc.returncode) == "KeyError: 'moe_ep_group'"


def test_a_chained_exception_is_the_one_that_ended_the_child():
    proc = _child("try:\n    1/0\nexcept ZeroDivisionError as e:\n    raise RuntimeError('the check failed') from e\n")
    assert child_failure(proc.stderr, proc.returncode) == "RuntimeError: the check failed"
    proc = _child("try:\n    1/0\nexcept ZeroDivisionError:\n    [][1]\n")
    assert child_failure(proc.stderr, proc.returncode) == "IndexError: list index out of range"


def test_an_exception_ignored_at_shutdown_is_not_the_reason():
    stderr = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nOSError: disk full\n"
              "Exception ignored in: <function _Worker.__del__ at 0x7f>\nTraceback (most recent call last):\n"
              "  File \"y.py\", line 2, in __del__\nAttributeError: 'NoneType' object has no attribute 'close'\n")
    assert last_exception(stderr) == "OSError: disk full"


@pytest.mark.parametrize("stderr, code, expected", [
    ("", -9, "killed by SIGKILL (out of memory, or stopped by someone)"),
    ("Loading: 100%|###|\n", -15, "killed by SIGTERM"),
    ("usage: x [-h]\nx: error: the following arguments are required: --record\n", 2,
     "x: error: the following arguments are required: --record"),
    ("Collecting foo\nERROR: Could not find a version that satisfies the requirement foo\n"
     "ERROR: No matching distribution found for foo\n", 1, "ERROR: No matching distribution found for foo"),
    ("/r/infer.sh: line 3: syntax error near unexpected token `fi'\n/r/infer.sh: line 3: `fi'\n", 2,
     "/r/infer.sh: line 3: syntax error near unexpected token `fi'"),
    (f"{TQDM}\n", 3, "exit code 3, no error message"),
    ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"a.py\", line 1\n[rank0]: KeyError: 'x'\n", 1,
     "KeyError: 'x'"),
])
def test_without_a_traceback_the_exit_status_or_an_error_line(stderr, code, expected):
    assert child_failure(stderr, code) == expected


def test_a_timeout_says_so_whatever_was_printed():
    assert child_failure("Traceback (most recent call last):\nKeyboardInterrupt\n", None, timed_out=True,
                         timeout_s=900) == "timed out after 900 s"


def test_a_long_message_is_one_bounded_line():
    why = child_failure("Traceback (most recent call last):\n  File \"a\", line 1\nValueError: " + "x" * 1000 + "\n", 1)
    assert len(why) <= 300 and "\n" not in why and why.startswith("ValueError: xxx")


def test_a_failed_run_without_a_traceback_is_never_summarised_by_a_progress_bar(tmp_path):
    """The trial run's summary (agent.repair.failure.summarise_failure, agent.run.trial_run.summarise): its
    fallback without a traceback skips progress bars, and a run a signal ended says which signal."""
    from agent.repair.failure import summarise_failure
    from agent.run.trial_run import Verdict, summarise

    output = f"[rank0] loading the checkpoint\n{TQDM}\n"
    assert summarise_failure(output)["error"] == "[rank0] loading the checkpoint"
    recipe = type("R", (), {"path": tmp_path, "repo_root": None})()
    line = summarise(output, recipe, -9, False, 60, Verdict(problem=None))
    assert line.startswith("killed by SIGKILL (out of memory, or stopped by someone): ") and "it/s" not in line
