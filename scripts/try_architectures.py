#!/usr/bin/env python3
"""Migrate tiny checkpoints of many transformers architectures and print a coverage table.

    python scripts/try_architectures.py granite starcoder2 olmoe ... [--out DIR] [--json FILE]

Each architecture: build a tiny random checkpoint, `migrator run --device cpu --json`, then read
status, family and parity from the recipe's baseline/report. Nothing is special-cased.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def try_one(model_type: str, out: Path) -> dict:
    from agent.tiny_checkpoint import build_tiny_checkpoint

    row = {"model_type": model_type}
    start = time.perf_counter()
    try:
        ckpt = build_tiny_checkpoint(model_type, out / "ckpt" / model_type)
    except Exception as exc:  # the tiny-config builder itself, not the migrator
        return dict(row, status="fixture-failed", message=f"{type(exc).__name__}: {str(exc)[:160]}")
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "run", str(ckpt), "--name", model_type,
                           "--output-dir", str(out / "recipes"), "--device", "cpu", "--json"],
                          capture_output=True, text=True)
    row["seconds"] = round(time.perf_counter() - start, 1)
    try:
        summary = json.loads(proc.stdout)
    except ValueError:
        error = [ln for ln in proc.stderr.splitlines() if ln.startswith("migrator: error")]
        return dict(row, status=f"exit {proc.returncode}", message=(error or proc.stderr.splitlines()[-1:] or [""])[0][:200])
    row.update(status=summary.get("status"), family=summary.get("family"), message=summary.get("message", "")[:200])
    baseline = out / "recipes" / model_type / "baseline" / "baseline_metadata.json"
    if baseline.is_file():
        parity = json.loads(baseline.read_text())["verification"].get("parity") or {}
        row.update(max_abs_logits_diff=parity.get("max_abs_logits_diff"),
                   greedy_tokens_equal=parity.get("greedy_tokens_equal"))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_types", nargs="+")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--json", type=Path, help="write the rows as JSON")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="archs_"))
    rows = []
    for model_type in args.model_types:
        rows.append(try_one(model_type, out))
        r = rows[-1]
        print(f"{r['model_type']:<18} {r['status']:<14} {r.get('family') or '':<15} "
              f"diff={r.get('max_abs_logits_diff')} tokens_equal={r.get('greedy_tokens_equal')} "
              f"{r.get('seconds', '')}s {r.get('message') or ''}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
