#!/usr/bin/env python3
"""Which causal-LM architectures the native generator writes, and which fall back to the adapter.

    python scripts/native_coverage.py [TYPE ...] [--types-of PYTHON] [--defaults] [--markdown FILE] [--json FILE]
                                      [--chunk N]

Without TYPE: every model type of the installed transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES; with
`--types-of PYTHON`, those of the transformers that interpreter imports (`.venv-tf5.0/bin/python`: upstream's pin
5.0.0), measured with the installed one (a type it does not have is named on stderr, not measured). Each type is
measured on a checkpoint-shaped config (agent.testing.checkpoint_shapes: the keys of a published checkpoint's
config.json that choose code paths — layer kinds, sliding windows, rope scaling, MoE layout — over transformers'
defaults), or on transformers' default config where no shape is recorded (the row says which; `--defaults`:
defaults for every type), as `migrator run --target framework` sees a checkpoint's config.json. A type the
migrator refuses (encoder-only, the decoder half of an encoder-decoder, image-text, ...:
agent.migrate.vendor.refusal_reason) is not testable. For the rest, agent.recipe.native.compose.derive picks the
architecture's parts from its code and that config, or names the layer kind it does not write (NotNative: kind,
reason); a derived type's file is rendered and held to transformers under the npu stand-in with the jobs the
generator runs before it writes one (agent.recipe.native.decide.selfcheck_jobs: the config in float32 and in the
run dtype bfloat16, and each family setting the file reads in float32; agent.recipe.native.selfcheck: a packed
prefill of prompts of unequal length and decode steps on a paged cache). Each row ends in

  native        derived and every job within the self-check's tolerance (its float32 largest relative logit
                difference)
  fell back     the layer kind and why (the recipe keeps the adapter, as `migrator run` says)
  refused       the migrator does not serve the type (not a testable causal LM)
  hf-fails      transformers itself runs none of the tiny configs scripts/try_architectures.py tries (no
                oracle here: not testable)
  no config     transformers cannot make the type's config here

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
from engine.safe_load import load_json, loads_json  # noqa: E402


def all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def types_of(python: str) -> tuple[str, list[str]]:
    """(version, causal-LM types) of the transformers another interpreter imports; ValueError in one line."""
    import subprocess

    code = ("import json, transformers; from transformers.models.auto.modeling_auto import "
            "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as m; print(json.dumps([transformers.__version__, sorted(m)]))")
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"--types-of {python}: cannot run it ({exc})") from None
    if done.returncode != 0:
        reason = child_failure(done.stderr, done.returncode, stdout=done.stdout)
        raise ValueError(f"--types-of {python}: its transformers does not import ({reason})")
    lines = done.stdout.strip().splitlines()
    if not lines:
        raise ValueError(f"--types-of {python}: it printed nothing")
    try:
        version, types = loads_json(lines[-1], f"--types-of {python}'s answer")
    except (ValueError, TypeError) as exc:       # a LoadError is a ValueError
        raise ValueError(f"--types-of {python}: not its answer ({exc})") from None
    return version, types


def default_config(model_type: str) -> dict | None:
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(model_type).to_dict()
    except Exception:  # noqa: BLE001 - the type's own defaults do not validate here
        return None


def type_config(model_type: str, defaults: bool = False) -> tuple[dict | None, str]:
    """(the config a type is measured on, where it comes from): its checkpoint-shaped config where a shape is
    recorded (agent.testing.checkpoint_shapes), else (or with `defaults`) transformers' default config."""
    from agent.testing.checkpoint_shapes import checkpoint_config

    if not defaults:
        try:
            shaped = checkpoint_config(model_type)
        except Exception:  # noqa: BLE001 - transformers refuses the shape: measured on its defaults, said so
            shaped = None
        if shaped is not None:
            return shaped
    return default_config(model_type), "defaults"


def refused(model_type: str, config: dict) -> str | None:
    """The migrator's one-line refusal of the type (agent.migrate.vendor), or None: a type it serves."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import transformers
    from agent.errors import MigratorError
    from agent.migrate.vendor import check_servable, refusal_reason

    try:
        check_servable(config)
    except MigratorError as exc:
        return str(exc)
    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, ""), None)
    return refusal_reason(config, model_cls) if model_cls is not None else None


def ctx_for(model_type: str) -> dict:
    return {"model_name": f"cov_{model_type}", "framework_class": "CovForCausalLM", "display_name": model_type,
            "model_class": "ForCausalLM", "transformers_version": None}


# each type's derive runs under a time limit in a worker child (one for many types: the imports once): a config
# that stays large after shrinking, or a class that loops, costs that row, not the survey
DERIVE_TIMEOUT_S = 180
DERIVE_MEMORY_BYTES = 8 << 30


# the probe's refusals that may be transformers' own failure, not the generator's: told apart by
# try_architectures' tiny configs (agent.testing.tiny_runs)
TRANSFORMERS_FAILS = ("transformers cannot build it", "transformers refuses the config")


def transformers_fails(model_type: str, folder: Path) -> str | None:
    """transformers' errors when it runs none of the tiny configs try_architectures tries, else None."""
    import shutil

    from agent.testing.tiny_runs import checkpoint_for

    scratch = folder / f"tiny_{model_type}"
    try:
        ckpt, error, _ = checkpoint_for(model_type, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return None if ckpt is not None else (error or "no tiny config")


def derive_one(model_type: str, folder: Path, defaults: bool = False) -> dict:
    """One row: derive the type's parts and render its native file into `folder` (in this process)."""
    from agent.recipe.native.compose import derive
    from agent.recipe.native.decide import render_native
    from agent.recipe.native.not_native import NotNative

    config, source = type_config(model_type, defaults)
    if config is None:
        return {"type": model_type, "result": "no config", "config": source}
    why = refused(model_type, config)
    if why:
        return {"type": model_type, "result": "refused", "config": source, "reason": why}
    try:
        features = derive(config)
    except NotNative as exc:
        if exc.kind == "model" and exc.reason.startswith(TRANSFORMERS_FAILS):
            error = transformers_fails(model_type, folder)
            if error:
                return {"type": model_type, "result": "hf-fails", "config": source, "kind": "model",
                        "reason": f"transformers itself runs none of the tiny configs tried: {error}"}
        return {"type": model_type, "result": "fell back", "config": source, "kind": exc.kind, "reason": exc.reason}
    except Exception as exc:  # noqa: BLE001 - derive raising otherwise is a finding: a row, not a stop
        return {"type": model_type, "result": "fell back", "config": source, "kind": "derive",
                "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"}
    path = folder / f"modeling_{model_type}.py"
    path.write_text(render_native(ctx_for(model_type), features))
    return {"type": model_type, "result": "native", "config": source, "parts": features.parts,
            "moe": "moe" in features.parts, "mla": features.parts.get("attention") == "mla",
            "sliding": bool(features.options.get("WINDOWS")), "not_fused": list(features.unfused), "file": str(path),
            "variants": [[label, changes] for label, changes in features.checked_variants]}


class _Timeout(Exception):
    pass


def derive_many(types: list[str], folder: Path, defaults: bool) -> None:
    """The worker: each type's row written to `folder`/TYPE.json as it is derived, each under DERIVE_TIMEOUT_S."""
    import signal

    def expired(signum, frame):
        raise _Timeout()

    signal.signal(signal.SIGALRM, expired)
    for model_type in types:
        signal.alarm(DERIVE_TIMEOUT_S)
        try:
            row = derive_one(model_type, folder, defaults)
        except _Timeout:
            row = {"type": model_type, "result": "fell back", "kind": "derive",
                   "reason": f"derive took over {DERIVE_TIMEOUT_S} s"}
        finally:
            signal.alarm(0)
        (folder / f"{model_type}.json").write_text(json.dumps(row))
        print(f"[native_coverage] {model_type}: {row['result']} {row.get('kind', '')}", file=sys.stderr, flush=True)


def _limited() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (DERIVE_MEMORY_BYTES, DERIVE_MEMORY_BYTES))


def derive_all(types: list[str], folder: Path, defaults: bool) -> list[dict]:
    """Every type's row from worker children: a worker that dies costs the type it was on (its row says why) and
    the next worker goes on from the type after it."""
    import subprocess

    rows: dict = {}
    pending = list(types)
    while pending:
        proc = subprocess.run([sys.executable, __file__, "--derive-many", *pending, "--into", str(folder),
                               *(["--defaults"] if defaults else [])],
                              stdout=subprocess.DEVNULL, stderr=None, text=True, preexec_fn=_limited,
                              timeout=DERIVE_TIMEOUT_S * len(pending) + 60)
        done = [t for t in pending if (folder / f"{t}.json").is_file()]
        for model_type in done:
            rows[model_type] = load_json(folder / f"{model_type}.json")
        pending = [t for t in pending if t not in rows]
        if pending:
            stuck = pending.pop(0)
            why = child_failure("", proc.returncode, no_answer=f"the worker wrote no {stuck}.json")
            rows[stuck] = {"type": stuck, "result": "fell back", "kind": "derive", "reason": why}
    return [rows[t] for t in types]


def survey(types: list[str], checkout: Path, chunk: int, defaults: bool = False) -> list[dict]:
    from agent.recipe.native.decide import not_checkable, notes, selfcheck, selfcheck_jobs, unchecked, verdict

    with tempfile.TemporaryDirectory(prefix="native-coverage-") as tmp:
        rows = derive_all(types, Path(tmp), defaults)
        # each derived type's jobs as a migration runs them: float32, the run dtype, the family's settings
        derived = [(row, selfcheck_jobs(type_config(row["type"], defaults)[0], row.pop("variants"), row.pop("file"),
                                        "CovForCausalLM")) for row in rows if row["result"] == "native"]
        for start in range(0, len(derived), chunk):
            part = derived[start:start + chunk]
            print(f"[native_coverage] self-check {start + 1}-{start + len(part)} of {len(derived)}", file=sys.stderr,
                  flush=True)
            results = iter(selfcheck([job for _, labelled in part for _, job in labelled], checkout))
            for row, labelled in part:
                answers = [next(results) for _ in labelled]
                ok, row["max_rel"], why = verdict(labelled, answers)
                if not ok:
                    row.update(result="fell back", kind="self-check", reason=why)
                elif unchecked(labelled, answers):
                    row["not_checkable"] = [not_checkable(label, error) for label, error in unchecked(labelled, answers)]
                if ok and notes(labelled, answers):
                    row["notes"] = notes(labelled, answers)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| type | config | result | layer kind | why / self-check max relative logit difference |",
             "|---|---|---|---|---|"]
    for row in rows:
        config = row.get("config", "")
        if row["result"] == "native":
            kinds = "+".join(k for k in ("moe", "mla", "sliding") if row.get(k)) or "dense"
            said = " ".join("; ".join([*row.get("not_checkable", ()), *row.get("notes", ())]).split())[:300]
            said = said.replace("|", "\\|")
            lines.append(f"| {row['type']} | {config} | native | {kinds} | {row['max_rel']:.1e}"
                         f"{' (' + said + ')' if said else ''} |")
        else:
            why = " ".join((row.get("reason") or "").split())[:300].replace("|", "\\|")
            lines.append(f"| {row['type']} | {config} | {row['result']} | {row.get('kind', '')} | {why} |")
    return "\n".join(lines) + "\n\n" + summary(rows) + "\n"


def summary(rows: list[dict]) -> str:
    """The counts: native of the testable types (native or fell back), the rest by result."""
    counts = {r: sum(1 for row in rows if row["result"] == r)
              for r in ("native", "fell back", "refused", "hf-fails", "no config")}
    testable = counts["native"] + counts["fell back"]
    shaped = sum(1 for row in rows if row["result"] in ("native", "fell back") and row.get("config") != "defaults")
    return (f"{counts['native']} native of {testable} testable types ({shaped} on a checkpoint-shaped config); "
            f"{counts['fell back']} fell back, {counts['refused']} refused, {counts['hf-fails']} hf-fails, "
            f"{counts['no config']} no config; {len(rows)} types")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("types", nargs="*", help="model types (default: every causal-LM type)")
    parser.add_argument("--types-of", metavar="PYTHON",
                        help="the causal-LM types of the transformers this interpreter imports (e.g. .venv-tf5.0/bin/python)")
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--chunk", type=int, default=4, help="types self-checked per stand-in process (each its jobs)")
    parser.add_argument("--defaults", action="store_true",
                        help="every type on transformers' default config (not its checkpoint shape)")
    parser.add_argument("--derive-many", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--into", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.derive_many:
        derive_many(args.types, args.into, args.defaults)
        return 0
    checkout = Path(os.environ.get("CHECKOUT") or REPO.parent / "shared" / "upstream" / "cann-recipes-infer")
    if not (checkout / "module").is_dir():
        print(f"native_coverage: no cann-recipes-infer checkout at {checkout} (set CHECKOUT=PATH)", file=sys.stderr)
        return 2
    types, population = args.types or all_types(), ""
    if args.types_of:
        try:
            version, theirs = types_of(args.types_of)
        except ValueError as exc:
            print(f"native_coverage: {exc}", file=sys.stderr)
            return 2
        installed = set(all_types())
        lacking = sorted(set(theirs) - installed)
        if lacking:
            print(f"native_coverage: not in the installed transformers, not measured: {' '.join(lacking)}",
                  file=sys.stderr)
        types = [t for t in theirs if t in installed and (not args.types or t in args.types)]
        population = f"The causal-LM types of transformers {version} ({len(theirs)}; {len(lacking)} not installed here):\n\n"
    rows = survey(types, checkout, max(1, args.chunk), args.defaults)
    text = population + markdown(rows)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
