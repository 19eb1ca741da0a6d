#!/usr/bin/env python3
"""Which image-text types the native generator serves by their text decoder.

    python scripts/image_text_coverage.py [TYPE ...] [--json FILE]

Without TYPE: every model type of the installed transformers' MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES. For each,
on a tiny checkpoint-shaped config of the type (agent.testing.tiny_checkpoint.tiny_config: its text and vision
configs at tiny widths, as a checkpoint's config.json holds them): agent.recipe.text_decoder finds its text
decoder in transformers' image-text class, agent.recipe.native.compose.derive picks the decoder's parts, and the
file is held under the npu stand-in to transformers' image-text model on text-only prompts with the jobs a migration
runs (agent.recipe.native.decide.selfcheck_jobs: float32, the run dtype bfloat16, the family's settings; a packed
prefill and decode steps, agent.recipe.native.selfcheck). Each row ends in

  native        the decoder's file within the self-check's tolerance of the image-text model
  fell back     why (no text decoder transformers names, a decoder type the generator does not write, ...)
  no config     transformers cannot make the type's tiny config or model here

Before image-text checkpoints were served by their text decoder, every one was refused
(agent.migrate.vendor.image_text_reason): 0 native. The self-check needs a cann-recipes-infer checkout:
../shared/upstream/cann-recipes-infer beside this repository, or CHECKOUT=PATH.
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


def all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def one_line(exc: BaseException, limit: int = 160) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:limit]


def survey(types: list[str], checkout: Path, folder: Path) -> list[dict]:
    from agent.recipe.text_decoder import NotServedByText, text_decoder
    from agent.recipe.native.compose import derive
    from agent.recipe.native.decide import render_native, selfcheck, selfcheck_jobs, verdict
    from agent.recipe.native.not_native import NotNative
    from agent.testing.tiny_checkpoint import tiny_config

    rows, jobs = [], []
    for model_type in types:
        row = {"type": model_type}
        rows.append(row)
        try:
            config = tiny_config(model_type, vocab_size=384).to_dict()
        except Exception as exc:  # noqa: BLE001 - transformers cannot make the type's config here
            row.update(status="no config", reason=one_line(exc))
            continue
        try:
            decoder = text_decoder(config)
            composition = derive(config)
        except (NotServedByText, NotNative) as exc:
            row.update(status="fell back", reason=getattr(exc, "reason", None) or str(exc))
            continue
        except Exception as exc:  # noqa: BLE001 - transformers' own code failed on the tiny config
            row.update(status="no config", reason=one_line(exc))
            continue
        row.update(decoder=decoder.causal_lm_type, text_type=decoder.text_type, at=decoder.decoder_prefix,
                   skipped=list(decoder.skipped))
        ctx = {"model_name": f"cov_{model_type}", "framework_class": "CovForCausalLM", "display_name": model_type,
               "model_class": decoder.image_text_class, "transformers_version": None}
        path = folder / f"modeling_cov_{model_type}.py"
        path.write_text(render_native(ctx, composition))
        jobs.append((row, selfcheck_jobs(config, composition.checked_variants, str(path), "CovForCausalLM")))
    # a migration's jobs (float32, the run dtype, the family's settings), several types' per stand-in process
    for start in range(0, len(jobs), 4):
        chunk = jobs[start:start + 4]
        results = iter(selfcheck([job for _, labelled in chunk for _, job in labelled], checkout))
        for row, labelled in chunk:
            ok, max_rel, why = verdict(labelled, [next(results) for _ in labelled])
            if ok:
                row.update(status="native", selfcheck_max_rel=max_rel)
            else:
                row.update(status="fell back", reason=f"self-check: {why}")
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Image-text types served natively by their text decoder.")
    parser.add_argument("types", nargs="*", help="model types (default: every image-text type of transformers)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    import transformers

    checkout = Path(os.environ.get("CHECKOUT") or REPO.parent / "shared" / "upstream" / "cann-recipes-infer")
    if not (checkout / "executor").is_dir():
        print(f"no cann-recipes-infer checkout at {checkout}: set CHECKOUT=PATH", file=sys.stderr)
        return 2
    types = args.types or all_types()
    with tempfile.TemporaryDirectory(prefix="image_text_coverage") as tmp:
        rows = survey(types, checkout, Path(tmp))
    for row in rows:
        detail = (f"{row['decoder']} at {row['at']}, max rel {row['selfcheck_max_rel']:.1e}" if row["status"] == "native"
                  else row.get("reason", ""))
        print(f"{row['type']:28} {row['status']:10} {detail[:200]}")
    native = [row["type"] for row in rows if row["status"] == "native"]
    print(f"\ntransformers {transformers.__version__}: {len(native)} of {len(rows)} image-text types served natively "
          f"by their text decoder: {', '.join(native)}")
    if args.json:
        from engine.safe_write import UserTree

        UserTree(args.json.parent, "the output folder").write_text(args.json, json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
