"""Time of the vendor step (locate the source + copy + codemods) with and without the codemod cache.

    python scripts/bench_vendor.py qwen3_moe gemma3_text qwen3_next

Builds a tiny checkpoint of each type, then times `locate_source` + `vendor_source` in this process
(torch already imported, as in `migrator run`): once with the cache off, then twice with it on (the
first fills it, the second reads it). Prints one line per run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_types", nargs="*", default=["llama"], metavar="MODEL_TYPE",
                        help="transformers model types to time (default: llama)")
    types = parser.parse_args(argv).model_types
    from engine.environment import import_torch

    import_torch()
    from agent.testing.tiny_checkpoint import build_tiny_checkpoint
    from agent.migrate.vendor import locate_source, read_config, vendor_source

    with tempfile.TemporaryDirectory(prefix="bench_vendor_") as tmp:
        os.environ["XDG_CACHE_HOME"] = str(Path(tmp) / "cache")   # a cache of its own: cold means cold
        for model_type in types:
            try:
                ckpt = build_tiny_checkpoint(model_type, Path(tmp) / model_type)
            except ValueError as exc:
                print(f"bench_vendor: cannot build a tiny {model_type!r} checkpoint: {str(exc).splitlines()[0][:160]}"
                      " — name a decoder model type transformers knows (e.g. llama, qwen3_moe)", file=sys.stderr)
                return 2
            config = read_config(ckpt)
            for i, label in enumerate(("cache off", "cache fill", "cache hit")):
                if i == 0:
                    os.environ["MIGRATOR_NO_CODEMOD_CACHE"] = "1"
                else:
                    os.environ.pop("MIGRATOR_NO_CODEMOD_CACHE", None)
                start = time.perf_counter()
                vendor_source(locate_source(config, ckpt), Path(tmp) / f"recipe_{model_type}_{i}", "x")
                print(f"{model_type:14} {label:10} {time.perf_counter() - start:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
