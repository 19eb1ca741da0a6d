#!/usr/bin/env python3
"""Collect a recipe's performance baseline from its inference logs (the code is agent.measure.baseline).

    python3 scripts/collect_baseline.py --log-file RES_PATH_OR_LOG --output OUT.json \\
        --yaml-file config/model.yaml [--rank N] [--model-source SRC]

Exit codes: 0 written; 2 bad input (missing/unreadable log or YAML, bad
arguments); 3 the log has no formal prefill line (the run failed); 1 anything
unexpected. Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

# Runs from any working directory, also where infer-migrator is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.measure.baseline import (  # noqa: E402
    EXIT_OK, EXIT_UNEXPECTED, PROG, CollectError, collect, error_line, write_baseline)

EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        raise CollectError(message.replace("\n", " "), f"run '{self.prog} --help' for usage")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="collect_baseline.py",
                description="Collect a recipe's performance baseline from its inference logs.")
    p.add_argument("--log-file", required=True,
                   help="log file, or the RES_PATH directory holding log_{rank}.log")
    p.add_argument("--output", required=True, help="baseline JSON to write")
    p.add_argument("--yaml-file", required=True, help="the recipe's config YAML")
    p.add_argument("--rank", type=int, default=0, help="rank whose log is measured (default 0)")
    p.add_argument("--model-source", default=None,
                   help="model source to record (default: YAML model_source, else model_path)")
    return p


def _fmt_ms(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f} ms"


def main(argv: Optional[list[str]] = None) -> int:
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:  # --help
            return exc.code if isinstance(exc.code, int) else EXIT_OK
        baseline, warnings = collect(args.log_file, args.yaml_file, args.rank, args.model_source)
        out = Path(args.output)
        kept = write_baseline(out, baseline)
    except CollectError as exc:
        print(error_line(exc), file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print(f"{PROG}: error: interrupted — nothing written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # never a traceback
        print(error_line(exc), file=sys.stderr)
        return EXIT_UNEXPECTED
    for w in warnings:
        print(f"{PROG}: warning: {w}".replace("\n", " "), file=sys.stderr)
    if kept is not None:
        print(f"{PROG}: kept previous baseline as {kept}")
    perf = baseline["performance"]
    print(f"{PROG}: prefill {_fmt_ms(perf['prefill_ms'])}, decode avg "
          f"{_fmt_ms(perf['decode_avg_ms'])} -> {out}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
