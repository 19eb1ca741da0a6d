#!/usr/bin/env python3
"""Which causal-LM architectures the native generator writes, and which fall back to the adapter.

    python scripts/native_coverage.py [TYPE ...] [--markdown FILE] [--json FILE] [--chunk N]

Without TYPE: every model type of the installed transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES. For each,
on transformers' default config of the type (as `migrator run --target framework` sees a checkpoint's
config.json): agent.recipe.native.compose.derive picks the architecture's parts from its code, or names the layer
kind it does not write (NotNative: kind, reason); a derived type's file is rendered and held to
transformers in float32 under the npu stand-in (agent.recipe.native.selfcheck: a packed prefill of
prompts of unequal length and decode steps on a paged cache), as the generator does before it writes one. Each row ends in

  native        derived and within the self-check's tolerance (its largest relative logit difference)
  fell back     the layer kind and why (the recipe keeps the adapter, as `migrator run` says)
  no config     transformers cannot make the type's default config here

The self-check needs a cann-recipes-infer checkout (module/, executor/): ../shared/upstream/cann-recipes-infer
beside this repository, or CHECKOUT=PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.child_failure import child_failure  # noqa: E402 - the repository on sys.path first
from engine.safe_load import load_json  # noqa: E402


def all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def default_config(model_type: str) -> dict | None:
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(model_type).to_dict()
    except Exception:  # noqa: BLE001 - the type's own defaults do not validate here
        return None


def ctx_for(model_type: str) -> dict:
    return {"model_name": f"cov_{model_type}", "framework_class": "CovForCausalLM", "display_name": model_type,
            "model_class": "ForCausalLM", "transformers_version": None}


# a type's derive runs in a child of its own: a default config that stays large after shrinking, or a class that
# loops, costs that row, not the survey
DERIVE_TIMEOUT_S = 180
DERIVE_MEMORY_BYTES = 8 << 30


def derive_one(model_type: str, folder: Path) -> dict:
    """One row: derive the type's features and render its native file into `folder` (in this process)."""
    from agent.recipe.native.compose import derive
    from agent.recipe.native.decide import render_native
    from agent.recipe.native.not_native import NotNative

    config = default_config(model_type)
    if config is None:
        return {"type": model_type, "result": "no config"}
    try:
        features = derive(config)
    except NotNative as exc:
        return {"type": model_type, "result": "fell back", "kind": exc.kind, "reason": exc.reason}
    except Exception as exc:  # noqa: BLE001 - derive raising otherwise is a finding: a row, not a stop
        return {"type": model_type, "result": "fell back", "kind": "derive",
                "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"}
    path = folder / f"modeling_{model_type}.py"
    path.write_text(render_native(ctx_for(model_type), features))
    return {"type": model_type, "result": "native", "parts": features.parts, "moe": "moe" in features.parts,
            "mla": features.parts.get("attention") == "mla", "sliding": bool(features.options.get("WINDOWS")),
            "not_fused": list(features.unfused), "file": str(path)}


def _limited() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (DERIVE_MEMORY_BYTES, DERIVE_MEMORY_BYTES))


def derive_in_child(model_type: str, folder: Path) -> dict:
    import subprocess

    out = folder / f"{model_type}.json"
    try:
        proc = subprocess.run([sys.executable, __file__, "--derive-one", model_type, "--into", str(folder)],
                              capture_output=True, text=True, timeout=DERIVE_TIMEOUT_S, preexec_fn=_limited)
    except subprocess.TimeoutExpired:
        return {"type": model_type, "result": "fell back", "kind": "derive",
                "reason": f"derive took over {DERIVE_TIMEOUT_S} s"}
    if proc.returncode != 0 or not out.is_file():
        why = child_failure(proc.stderr, proc.returncode, no_answer=f"it wrote no {out.name}")
        return {"type": model_type, "result": "fell back", "kind": "derive", "reason": why}
    return load_json(out)


def survey(types: list[str], checkout: Path, chunk: int) -> list[dict]:
    from agent.recipe.native.decide import selfcheck

    rows = []
    with tempfile.TemporaryDirectory(prefix="native-coverage-") as tmp:
        for model_type in types:
            row = derive_in_child(model_type, Path(tmp))
            rows.append(row)
            print(f"[native_coverage] {model_type}: {row['result']} {row.get('kind', '')}", file=sys.stderr, flush=True)
        jobs = [row for row in rows if row["result"] == "native"]
        for start in range(0, len(jobs), chunk):
            part = jobs[start:start + chunk]
            print(f"[native_coverage] self-check {start + 1}-{start + len(part)} of {len(jobs)}", file=sys.stderr,
                  flush=True)
            results = selfcheck([{"config": default_config(row["type"]), "file": row.pop("file"),
                                  "class_name": "CovForCausalLM"} for row in part], checkout)
            for row, result in zip(part, results):
                row["max_rel"] = result["max_rel"]
                if not result["ok"]:
                    row.update(result="fell back", kind="self-check", reason=result["reason"])
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| type | result | layer kind | why / self-check max relative logit difference |", "|---|---|---|---|"]
    for row in rows:
        if row["result"] == "native":
            kinds = "+".join(k for k in ("moe", "mla", "sliding") if row.get(k)) or "dense"
            lines.append(f"| {row['type']} | native | {kinds} | {row['max_rel']:.1e} |")
        else:
            why = (row.get("reason") or "").replace("|", "\\|")
            lines.append(f"| {row['type']} | {row['result']} | {row.get('kind', '')} | {why} |")
    counts = {r: sum(1 for row in rows if row["result"] == r) for r in ("native", "fell back", "no config")}
    return "\n".join(lines) + "\n\n" + ", ".join(f"{n} {r}" for r, n in counts.items()) + f" of {len(rows)} types\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("types", nargs="*", help="model types (default: every causal-LM type)")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--chunk", type=int, default=12, help="self-check jobs per stand-in process")
    parser.add_argument("--derive-one", help=argparse.SUPPRESS)
    parser.add_argument("--into", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.derive_one:
        row = derive_one(args.derive_one, args.into)
        (args.into / f"{args.derive_one}.json").write_text(json.dumps(row))
        return 0
    checkout = Path(os.environ.get("CHECKOUT") or REPO.parent / "shared" / "upstream" / "cann-recipes-infer")
    if not (checkout / "module").is_dir():
        print(f"native_coverage: no cann-recipes-infer checkout at {checkout} (set CHECKOUT=PATH)", file=sys.stderr)
        return 2
    rows = survey(args.types or all_types(), checkout, max(1, args.chunk))
    text = markdown(rows)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
