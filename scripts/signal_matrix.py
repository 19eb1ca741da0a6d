"""SIGKILL / SIGINT / SIGTERM x node: what a signal to `migrator run` does, and what `--resume` does after.

    python scripts/signal_matrix.py [--signals KILL,INT,TERM] [--nodes acquire,vendor,...]  (default: every node)

For each pair: migrate the shipped demo model into a fresh output folder, send the signal to the
migrator when its progress line says the node started, then record its exit code and stderr line,
the processes of its tree still alive 1 s later (every process carries a tag in its environment),
and the exit code and first progress line of `migrator run ... --resume`. Prints a table.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIGNALS = {"KILL": signal.SIGKILL, "INT": signal.SIGINT, "TERM": signal.SIGTERM}
NODES = ["detect_env", "classify", "acquire", "vendor", "decide_native", "render", "trial_run", "collect_baseline", "verify", "report"]


def tagged(tag: str) -> int:
    alive = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"MATRIX_TAG={tag}".encode() in (entry / "environ").read_bytes() and \
                        "State:\tZ" not in (entry / "status").read_text():
                    alive += 1
            except OSError:
                pass
    return alive


def one(sig: str, node: str, work: Path) -> dict:
    from agent.paths import demo_model_dir

    out = work / f"{sig}_{node}"
    args = [sys.executable, "-m", "agent.cli", "run", str(demo_model_dir()), "--name", "m", "--output-dir", str(out),
            "--device", "cpu", "--max-new-tokens", "4"]
    tag = uuid.uuid4().hex
    env = dict(os.environ, MATRIX_TAG=tag, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith(f"[migrator] {node} ..."):
            time.sleep(0.5)
            proc.send_signal(SIGNALS[sig])
            break
    rest = proc.communicate(timeout=300)[1]
    error = next((ln for ln in rest.splitlines() if ln.startswith("migrator:")), "")
    time.sleep(1)
    left = tagged(tag)
    resumed = subprocess.run(args + ["--resume"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    first = next((ln for ln in resumed.stderr.splitlines() if "resum" in ln or "starting" in ln), "")
    return {"signal": sig, "node": node, "exit": proc.returncode, "line": error, "left": left,
            "resume_exit": resumed.returncode, "resume": first.replace("[migrator] ", ""),
            "traceback": "Traceback" in rest}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--signals", default="KILL,INT,TERM")
    parser.add_argument("--nodes", default=",".join(NODES))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    rows = []
    with tempfile.TemporaryDirectory(prefix="signal-matrix-") as tmp:
        for sig in args.signals.split(","):
            for node in args.nodes.split(","):
                row = one(sig, node, Path(tmp))
                rows.append(row)
                print(f"| {row['signal']} | {row['node']} | {row['exit']} | {row['line'][:120]} | {row['left']} | "
                      f"{row['traceback']} | {row['resume_exit']} | {row['resume']} |", flush=True)
    print("| signal | node | exit | said | processes left | traceback | --resume exit | --resume said |")
    failing = [r for r in rows if not holds(r)]
    for r in failing:
        print(f"does not hold: {r}")
    return 1 if failing else 0


EXIT_OF = {"INT": 130, "TERM": 143, "KILL": -9}


def holds(row: dict) -> bool:
    """What tests/e2e/test_fuzz_inputs.py asks of a pair: no traceback; a run the signal stopped exits with the
    signal's code, and (INT / TERM) leaves no process of its tree and says --resume; --resume then finishes."""
    if row["traceback"] or row["resume_exit"] != 0:
        return False
    if row["exit"] == 0:                 # a node faster than the signal: the run had finished
        return True
    return row["exit"] == EXIT_OF[row["signal"]] and (row["signal"] == "KILL" or (row["left"] == 0
                                                                                  and "--resume" in row["line"]))


if __name__ == "__main__":
    sys.exit(main())
