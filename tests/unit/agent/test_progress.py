"""Progress output (agent.progress): a real trial run of a launch script that writes its rank log as it
goes, once in a pseudo-terminal (rich's live display with the token counter) and once with stderr a
pipe (plain lines, no escape codes); the counter's reading of rank logs in the formats it knows."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from agent.progress import RankLogCounter
from locations import REPO_ROOT

REPO = REPO_ROOT
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

# A legacy recipe (its own infer.sh) whose run logs like this tool's engine: a warm-up call logged at
# once, then a formal call whose decode steps come STEP_S apart; STOP_AFTER decode steps, it dies.
INFER_SH = r"""#!/bin/bash
log="$RES_PATH/log_0.log"
say() { echo "[2026-12-01 10:00:00,000] [INFO] $*" >> "$log"; }
say "probe warm-up run begins"
say "probe inference time cost of prefill is 5.00 ms"
for i in 1 2 3; do say "probe inference time cost of decode is 1.00 ms"; done
say "Request 0: outputs: warm"
say "probe warm-up run ends"
say "probe inference time cost of prefill is 5.00 ms"
for i in 1 2 3; do
  sleep "${STEP_S:-0.6}"
  if [ "$i" = "${STOP_AFTER:-}" ]; then echo "Traceback (most recent call last):"; echo "RuntimeError: stop"; exit 1; fi
  say "probe inference time cost of decode is 1.00 ms"
done
say "Request 0: outputs: hello"
"""

RUN = textwrap.dedent("""
    import sys
    from agent.progress import step
    from agent.recipe.recipe import Recipe
    from agent.run.trial_run import trial_run
    with step("trial_run"):
        run = trial_run(Recipe.at(sys.argv[1]), "probe")
    print("OK" if run["ok"] else "FAILED")
""")


def _recipe(tmp_path: Path) -> Path:
    recipe = tmp_path / "probe"
    (recipe / "config").mkdir(parents=True)
    (recipe / "config" / "probe.yaml").write_text("model_name: probe\ndata_config:\n  max_new_tokens: 4\n")
    (recipe / "infer.sh").write_text(INFER_SH)
    return recipe


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR")}
    return dict(env, PYTHONPATH=str(REPO), COLUMNS="120", TERM="xterm", **extra)


def _run_in_pty(recipe: Path, env: dict) -> tuple[int, str]:
    """The run with stdin, stdout and stderr on a pseudo-terminal; all it wrote, as bytes decoded."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(recipe)], stdin=follower, stdout=follower,
                            stderr=follower, env=env, cwd=REPO, close_fds=True)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:   # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    return proc.wait(timeout=120), out.decode("utf-8", errors="replace")


def test_trial_run_in_a_terminal_shows_the_live_token_counter(tmp_path):
    recipe = _recipe(tmp_path)
    rc, out = _run_in_pty(recipe, _env())
    assert rc == 0, out[-2000:]
    assert "OK" in out
    assert ANSI.search(out), "no live display on a terminal"
    frames = ANSI.sub("", out)
    # While the formal call runs, the counter shows the tokens the rank log holds so far.
    seen = {int(n) for n in re.findall(r"trial run probe: formal call\s.*?(\d)/4 tokens", frames)}
    assert seen & {1, 2, 3}, frames[-3000:]
    assert "waiting for log_0.log" in frames
    # The step's own line ticks: its elapsed time passes a second while the formal call runs.
    assert re.search(r"trial_run\s+0:00:0[1-9]", frames), frames[-3000:]
    assert "[migrator] trial run probe: warm-up call 4/4 tokens" in frames
    assert "[migrator] trial run probe: formal call 4/4 tokens" in frames
    assert re.search(r"\[migrator\] trial_run done in \d+\.\ds", frames)


def test_trial_run_without_a_terminal_prints_plain_lines(tmp_path):
    recipe = _recipe(tmp_path)
    proc = subprocess.run([sys.executable, "-c", RUN, str(recipe)], env=_env(STEP_S="0.1"), cwd=REPO,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK"
    assert "\x1b" not in proc.stderr and "\r" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[:3] == ["[migrator] trial_run ...",
                         "[migrator] trial run probe: warm-up call 4/4 tokens",
                         "[migrator] trial run probe: formal call 4/4 tokens"], proc.stderr
    assert re.fullmatch(r"\[migrator\] trial_run done in \d+\.\ds", lines[3])
    assert len(lines) == 4


def test_a_run_that_dies_mid_call_reports_the_unfinished_count(tmp_path):
    recipe = _recipe(tmp_path)
    proc = subprocess.run([sys.executable, "-c", RUN, str(recipe)], env=_env(STEP_S="0.1", STOP_AFTER="3"),
                          cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "FAILED"
    assert "[migrator] trial run probe: formal call 3/4 tokens (unfinished)" in proc.stderr.splitlines()
    assert "\x1b" not in proc.stderr


def _counter_over(tmp_path: Path, text: str, chunks: int = 1) -> RankLogCounter:
    """A counter fed `text` as a growing log_0.log, written in `chunks` pieces (cut mid-line)."""
    log = tmp_path / "log_0.log"
    log.write_text("")
    counter = RankLogCounter(lambda: tmp_path)
    step = -(-len(text) // chunks)
    for i in range(0, len(text), step):
        with open(log, "a") as f:
            f.write(text[i:i + step])
        counter.poll()
    return counter


def test_counter_reads_a_log_written_in_pieces(tmp_path):
    text = ("[2026-12-01 10:00:00,000] [INFO] m inference time cost of prefill is 5.00 ms\n"
            + "[2026-12-01 10:00:00,000] [INFO] m inference time cost of decode is 1.00 ms\n" * 5
            + "[2026-12-01 10:00:00,000] [INFO] Request 0: outputs: hi\n")
    counter = _counter_over(tmp_path, text, chunks=7)
    assert [(c.warmup, c.tokens, c.done) for c in counter.calls] == [(False, 6, True)]


def test_counter_counts_one_call_over_framework_prefill_batches(tmp_path):
    # cann-recipes-infer's scheduler logs one prefill line per prefill batch of the same call.
    line = "[INFO][2026-12-01 10:00:00.000][scheduler.py:1] [Main] Inference time ({}): 3.00 ms\n"
    text = line.format("prefill") * 2 + line.format("decode") * 3 + "Request 0: outputs: x\n" + line.format("prefill")
    counter = _counter_over(tmp_path, text)
    assert [(c.tokens, c.done) for c in counter.calls] == [(4, True), (1, False)]


def test_counter_waits_for_the_log_folder(tmp_path):
    counter = RankLogCounter(lambda: None)
    counter.poll()
    assert counter.calls == [] and counter.path is None


def test_expected_tokens_come_from_either_yaml_schema(tmp_path):
    from agent.recipe.recipe import Recipe
    from agent.run.trial_run import expected_tokens
    from engine import defaults

    recipe = _recipe(tmp_path)
    assert expected_tokens(Recipe.at(recipe)) == 4
    (recipe / "config" / "probe.yaml").write_text("model_config: {model_name: probe}\n"
                                                  "scheduler_config: {max_new_tokens: 7, batch_size: 1}\n")
    assert expected_tokens(Recipe.at(recipe)) == 7
    (recipe / "config" / "probe.yaml").write_text("data_config: {max_new_tokens: lots}\n")
    assert expected_tokens(Recipe.at(recipe)) == defaults.MAX_NEW_TOKENS
