"""Which torch_npu / torch.npu / torch.ops.npu / torchair names a source tree uses, and what the npu
stand-in does with each: a reference kernel, a runtime stand-in, or nothing (a one-line failure).

    python scripts/standin_coverage.py [CHECKOUT_OR_FOLDER] [--json out.json] [--missing-only]

Default folder: the upstream snapshot (../shared/upstream/cann-recipes-infer). The scan reads the
files with `ast` (npu_standin.scan); the classification resolves each name on the activated stand-in,
in a subprocess started with its environment.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", nargs="?", default=str(REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"))
    parser.add_argument("--json", help="write the table to this file")
    parser.add_argument("--missing-only", action="store_true", help="list only the names the stand-in lacks")
    return parser.parse_args(argv)


def classify(names: list[str]) -> dict[str, str]:
    import npu_standin

    code = ("import json, sys, torch\nfrom npu_standin.scan import coverage\n"
            "from engine.safe_load import loads_json\n"
            "print(json.dumps(coverage(loads_json(sys.stdin.read()))))\n")
    env = npu_standin.standin_env("cpu", base={**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))})
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(names), capture_output=True, text=True,
                          env=env, timeout=300)
    if proc.returncode != 0:
        sys.exit(f"classifying on the stand-in failed:\n{proc.stderr[-2000:]}")
    from engine.safe_load import loads_json

    return loads_json(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    args = parse_args(argv)
    from npu_standin.scan import kernel_name, scan_tree

    folder = Path(args.folder)
    if not folder.exists():
        sys.exit(f"{folder}: no such folder")
    result = scan_tree(folder)
    counts = result.counts()
    status = classify(sorted(counts))
    rows = []
    for name, uses in counts.most_common():
        first = result.first_use(name)
        rows.append({"name": name, "uses": uses, "kind": "kernel" if kernel_name(name) else "runtime",
                     "standin": status[name], "first_use": f"{first.file}:{first.line}"})
    missing = [r for r in rows if r["standin"] == "missing"]
    kernel_uses = sum(r["uses"] for r in rows if r["kind"] == "kernel")
    covered_kernel_uses = sum(r["uses"] for r in rows if r["kind"] == "kernel" and r["standin"] != "missing")
    print(f"{folder}: {result.files} files, {len(rows)} distinct names, {sum(counts.values())} uses; "
          f"{len(rows) - len(missing)} covered, {len(missing)} not; kernel call sites covered: "
          f"{covered_kernel_uses}/{kernel_uses}")
    for row in (missing if args.missing_only else rows):
        print(f"{row['uses']:5}  {row['standin']:8} {row['name']:70} {row['first_use']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"folder": str(folder), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
