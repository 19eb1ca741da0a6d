#!/usr/bin/env python3
"""Every model folder of a cann-recipes-infer checkout under the npu stand-in: one row per model.

    python scripts/upstream_standin_sweep.py CHECKOUT [--models M ...] [--world-size N] [--timeout S]
                                             [--out table.json]

The checkout is copied to a temporary folder first (upstream's tree is never touched; --in-place runs
on CHECKOUT itself). Each model runs as a user would run it, `migrator run models/M --standin --tiny
--max-rounds 0 --json`, under `nice`, with a wall-clock cap, by this interpreter (run the script with
the venv whose transformers you mean: upstream pins 5.0.0, `.venv-tf5.0/bin/python`). A model whose
folder has several YAMLs runs its default one for --world-size ranks (what `migrator run` picks).

Outcome per model:
  baseline+parity   exit 0: a baseline, parity against transformers checked (or why not)
  located mismatch  exit 1 with "diverges from transformers at ...": the first divergent layer
  exit 4            the op without a reference kernel (or compiled custom op) and its first call site
  exit 2            not a recipe / bad input, with the reason
  exit 1 / 3        the run failed otherwise (the line says why)
  timeout           the cap was reached (the line says at which stage)
The table is printed as markdown and written as JSON (--out), with the interpreter's transformers
version and the figures (parity ok, max |logits diff|, first divergent layer) where a run had them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from engine.safe_load import load_json, loads_json

REPO = Path(__file__).resolve().parents[1]


def outcome(rc: int | None, stderr: str, summary: dict) -> str:
    line = _last_line(stderr)
    if rc is None:
        return "timeout"
    if rc == 0:
        return "baseline+parity"
    if rc == 1 and "diverges from transformers" in (summary.get("message") or line):
        return "located mismatch"
    return f"exit {rc}"


def _last_line(stderr: str) -> str:
    """The run's one-line answer: its `migrator: error:` line, else its last line that is neither a
    stage line nor a progress bar."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip() and not ln.startswith("[migrator]")
             and "\r" not in ln and "it/s]" not in ln]
    errors = [ln for ln in lines if ln.startswith("migrator: error:")]
    return (errors or lines or [""])[-1]


def _parity(summary: dict) -> dict:
    path = summary.get("baseline_path")
    if not path or not Path(path).is_file():
        return {}
    try:
        baseline = load_json(Path(path))
    except ValueError:
        return {}
    parity = (baseline.get("verification") or {}).get("parity") or {}
    keep = ("reference", "ok", "checked", "reason", "max_abs_logits_diff", "steps_checked", "closest", "ties",
            "first_failing_step", "first_divergent_layer")
    return {k: parity[k] for k in keep if k in parity}


def run_one(models_dir: Path, name: str, world_size: int, timeout: int, niceness: int) -> dict:
    cmd = [sys.executable, "-m", "agent.cli", "run", str(models_dir / name), "--standin", "--tiny",
           "--max-rounds", "0", "--json", "--world-size", str(world_size)]
    env = {**os.environ, "NPU_STANDIN_COMPILE": os.environ.get("NPU_STANDIN_COMPILE", "capture")}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=(lambda: os.nice(niceness)) if niceness else None)
    try:
        out, err = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)                   # the run and its ranks, as one process group
        out, err = proc.communicate()
        rc = None
    summary = {}
    if out.strip().startswith("{"):
        try:
            summary = loads_json(out)
        except ValueError:
            summary = {}
    stages = [ln for ln in err.splitlines() if ln.startswith("[migrator]") and ln.endswith("...")]
    line = summary.get("message") or _last_line(err)
    if rc is None:
        line = f"over {timeout} s (last stage: {stages[-1][11:-4] if stages else 'start'})"
    return {"model": name, "world_size": world_size, "outcome": outcome(rc, err, summary), "exit": rc,
            "seconds": round(time.monotonic() - start, 1), "line": line.removeprefix("migrator: error: "),
            "parity": _parity(summary)}


def markdown(rows: list[dict]) -> str:
    out = ["| model | ranks | outcome | s | answer |", "|---|---|---|---|---|"]
    for r in rows:
        figures = ""
        p = r["parity"]
        if p.get("checked"):
            figures = (f" parity ok={p.get('ok')} max|dlogits|={p.get('max_abs_logits_diff')} (tol "
                       f"{p.get('tolerance')}), first divergent layer {p.get('first_divergent_layer')}")
        text = (r["line"] + figures).replace("|", "\\|")
        out.append(f"| {r['model']} | {r['world_size']} | {r['outcome']} | {r['seconds']} | {text[:400]} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a cann-recipes-infer checkout (its models/ folder is swept)")
    parser.add_argument("--models", nargs="*", help="model folder names (default: every folder of models/)")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per model (default 900)")
    parser.add_argument("--nice", type=int, default=10)
    parser.add_argument("--in-place", action="store_true", help="run on CHECKOUT itself, not a copy")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if not (args.checkout / "models").is_dir():
        print(f"error: {args.checkout} has no models/ folder (not a cann-recipes-infer checkout)", file=sys.stderr)
        return 2
    work = args.checkout
    scratch = None
    if not args.in_place:
        scratch = Path(tempfile.mkdtemp(prefix="upstream-sweep-"))
        work = scratch / args.checkout.name
        shutil.copytree(args.checkout, work, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        for path in [work, *work.rglob("*")]:
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | 0o200)
    names = args.models or sorted(p.name for p in (work / "models").iterdir() if p.is_dir())
    import transformers

    rows = []
    for name in names:
        row = run_one(work / "models", name, args.world_size, args.timeout, args.nice)
        rows.append(row)
        print(f"{name}: {row['outcome']} ({row['seconds']} s) {row['line'][:200]}", file=sys.stderr, flush=True)
    print(markdown(rows))
    if args.out:
        args.out.write_text(json.dumps({"checkout": str(args.checkout), "transformers": transformers.__version__,
                                        "world_size": args.world_size, "rows": rows}, indent=1) + "\n")
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
