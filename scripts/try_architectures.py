#!/usr/bin/env python3
"""Migrate tiny checkpoints of transformers architectures and print a coverage table.

    python scripts/try_architectures.py granite starcoder2 olmoe ... [--quick] [--out DIR] [--json FILE]
    python scripts/try_architectures.py --all [--quick] [--markdown FILE]

`--all` takes every model type of the installed transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.
Each type runs in its own subprocess (a time limit per type) and ends in one of:

  parity        migrated; the vendored model matches AutoModelForCausalLM (fp32 logits <= 1e-4,
                same greedy tokens)
  refused       the migrator refuses it (exit 3); the row gives its one-line reason
  hf-fails      transformers itself fails on every tiny config tried (2 layers, then 4 and 8 and
                the type's own layer count, naming an attention layer where the config can, then
                the type's own default config with all widths scaled down by one factor);
                the row gives transformers' error, or "not a tiny config" where no config
                tried stays under 30M parameters. Not counted as testable.
  failed        anything else: the row gives the error

Full mode (default) runs `migrator run --device cpu` and reads parity from the recipe's baseline.
`--quick` checks vendoring + parity only: vendor into a recipe dir, import the vendored modules in
a fresh process (no `transformers.models.*` import may remain but the auto registry), load the
weights with the vendored classes and compare logits and 8 greedy tokens with transformers; it
does not render or run the recipe (no infer.sh, no Runner, no baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from agent.testing.tiny_runs import checkpoint_for, tiny_checkpoints
from engine.safe_load import load_json, loads_json

REPO = Path(__file__).resolve().parent.parent
NAME = "m"

# Runs in the recipe dir (its `models` package on sys.path), in a fresh process.
QUICK_PROBE = textwrap.dedent("""
    import importlib, json, re, sys, warnings
    from pathlib import Path
    warnings.filterwarnings("ignore")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from engine.loading import check_loading_info, reuse_checkpoint_conversions
    ckpt, name, model_cls, config_cls, attn = sys.argv[1:6]
    leftover = [f"{f.name}: {line.strip()}" for f in sorted(Path("models").glob("*.py"))
                for line in f.read_text().splitlines()
                if re.match(r"\\s*(from|import) transformers[.]models[.](?!auto[ .])", line)]
    if leftover:
        print(json.dumps({"ok": False, "error": "vendored code still imports transformers.models: " + leftover[0]}))
        sys.exit(0)
    tok = AutoTokenizer.from_pretrained(ckpt)
    ids = tok(["An attention function can be described as mapping a query"], return_tensors="pt")
    gen = GenerationConfig(do_sample=False, max_new_tokens=8, min_new_tokens=8, eos_token_id=None,
                           pad_token_id=tok.pad_token_id)
    try:  # transformers itself, first: a failure here is not the migrator's
        ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation=attn).eval()
        with torch.inference_mode():
            ref_logits = ref(**ids).logits.float()
            b = ref.generate(**ids, generation_config=gen)[0].tolist()
        if not torch.isfinite(ref_logits).all():
            raise FloatingPointError("transformers' logits are not finite (nan/inf) on this config")
    except Exception as exc:
        print(json.dumps({"reference_error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:240]}"}))
        sys.exit(0)
    modeling = importlib.import_module(f"models.modeling_{name}")
    configuration = importlib.import_module(f"models.configuration_{name}")
    config = getattr(configuration, config_cls).from_pretrained(ckpt)
    Model = getattr(modeling, model_cls)
    reuse_checkpoint_conversions(Model, config)
    ours, info = Model.from_pretrained(ckpt, config=config, dtype=torch.float32, attn_implementation=attn,
                                       output_loading_info=True)
    check_loading_info(info, ckpt)
    assert type(ours).__module__.startswith("models."), type(ours).__module__
    ours.eval()
    with torch.inference_mode():
        diff = (ours(**ids).logits.float() - ref_logits).abs().max().item()
        a = ours.generate(**ids, generation_config=gen)[0].tolist()
    print(json.dumps({"ok": diff <= 1e-4 and a == b, "max_abs_logits_diff": diff, "greedy_tokens_equal": a == b}))
""")


def _env(*paths: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(REPO)])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _last_error(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("migrator: error")
              or (ln and not ln[0].isspace() and ("Error" in ln.split(":")[0] or "Exception" in ln.split(":")[0]))]
    return ((errors or lines or [""])[-1]).strip()[:300]


def refusal(model_type: str) -> str | None:
    """The migrator's refusal of this type, from a config.json alone (before any weights)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from agent.errors import UnsupportedModelError
    from agent.testing.tiny_checkpoint import tiny_config
    from agent.migrate.vendor import locate_source

    try:
        config = tiny_config(model_type, vocab_size=384).to_dict()
    except Exception:  # noqa: BLE001 - judged with the checkpoints below
        return None
    config["architectures"] = config.get("architectures") or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    try:
        locate_source(config)
    except UnsupportedModelError as exc:
        return str(exc).split("; supported:")[0]
    except Exception:  # noqa: BLE001 - other problems show in the run itself
        return None
    return None


def quick_check(model_type: str, out: Path) -> dict:
    """Vendor once, then probe each tiny config until transformers itself runs one."""
    from agent.errors import MigratorError
    from agent.migrate.vendor import locate_source, read_config, vendor_source

    recipe, source, errors = out / "recipe", None, []
    for layers, overrides, ckpt in tiny_checkpoints(model_type, out, errors):
        if source is None:
            try:
                source = locate_source(read_config(ckpt), ckpt)
                vendor_source(source, recipe, NAME)
            except MigratorError as exc:
                return {"status": "refused" if exc.exit_code == 3 else "failed",
                        "message": f"exit {exc.exit_code}: {exc}"[:300]}
            except Exception as exc:  # the migrator crashed
                return {"status": "failed", "message": f"vendoring: {type(exc).__name__}: {exc}"[:300]}
        try:
            proc = subprocess.run([sys.executable, "-c", QUICK_PROBE, str(ckpt), NAME, source.model_class,
                                   source.config_class, source.attn_implementation],
                                  cwd=recipe, env=_env(recipe), capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return {"status": "failed", "message": "probe timed out after 600 s"}
        try:
            result = loads_json(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {"status": "failed", "message": f"vendored model: {_last_error(proc.stderr)}"}
        if "reference_error" in result:
            errors.append(f"{layers}: {result['reference_error']}")
            continue
        if "error" in result:
            return {"status": "failed", "message": result["error"][:300]}
        status = "parity" if result["ok"] else "failed"
        message = "" if result["ok"] else (f"no parity: max |logits diff| {result['max_abs_logits_diff']:.3g}, "
                                           f"greedy tokens equal: {result['greedy_tokens_equal']}")
        return {"status": status, "message": message, "tiny_config": overrides or "default",
                "max_abs_logits_diff": result["max_abs_logits_diff"],
                "greedy_tokens_equal": result["greedy_tokens_equal"]}
    return {"status": "hf-fails", "message": " | ".join(errors)}


def full_check(ckpt: Path, out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "run", str(ckpt), "--name", NAME,
                           "--output-dir", str(out / "recipes"), "--device", "cpu", "--json"],
                          capture_output=True, text=True, env=_env(), cwd=REPO)
    if proc.returncode == 3:
        return {"status": "refused", "message": _last_error(proc.stderr)}
    try:
        summary = loads_json(proc.stdout)
    except ValueError:
        return {"status": "failed", "message": f"exit {proc.returncode}: {_last_error(proc.stderr)}"}
    row = {"family": summary.get("family"), "message": (summary.get("message") or "")[:300]}
    baseline = out / "recipes" / NAME / "baseline" / "baseline_metadata.json"
    parity = {}
    if baseline.is_file():
        parity = load_json(baseline)["verification"].get("parity") or {}
        row.update(max_abs_logits_diff=parity.get("max_abs_logits_diff"),
                   greedy_tokens_equal=parity.get("greedy_tokens_equal"))
    ok = summary.get("status") == "ok" and parity.get("ok") is True
    row["status"] = "parity" if ok else "failed"
    if not ok and not row["message"]:
        row["message"] = f"status {summary.get('status')}, parity {parity.get('reason') or parity.get('ok')}"
    return row


def try_one(model_type: str, out: Path, quick: bool) -> dict:
    """One type, end to end, in this process."""
    start = time.perf_counter()
    row = {"model_type": model_type}
    reason = refusal(model_type)
    if reason:
        return dict(row, status="refused", message=reason, seconds=round(time.perf_counter() - start, 1))
    if quick:
        row.update(quick_check(model_type, out))
    else:
        ckpt, error, overrides = checkpoint_for(model_type, out)
        if ckpt is None:
            return dict(row, status="hf-fails", message=error, seconds=round(time.perf_counter() - start, 1))
        row["tiny_config"] = overrides or "default"
        row.update(full_check(ckpt, out))
    if row["status"] in ("parity", "failed"):
        row["checked"] = "vendor + parity (quick)" if quick else "migrator run + parity"
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def try_in_process(model_type: str, out: Path) -> dict:
    """--quick: vendoring runs here (no vendored code is imported here), the probe in a subprocess."""
    try:
        return try_one(model_type, out / model_type, quick=True)
    except Exception as exc:  # the sweep goes on
        return {"model_type": model_type, "status": "failed", "message": f"sweep: {type(exc).__name__}: {exc}"[:300]}


MEMORY_LIMIT = 8 << 30   # address space of a sweep worker and its probes: one type cannot take the machine


def _limit_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run_batch(model_types: list[str], out: Path, timeout: int) -> list[dict]:
    """--quick: a few types per worker process (imports paid once, memory returned after each
    batch); a type the crashed worker did not report is retried alone."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", ",".join(model_types), "--out", str(out), "--quick"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout * len(model_types),
                              env=_env(), cwd=REPO, preexec_fn=_limit_memory)
        stdout = proc.stdout
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    rows = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            row = loads_json(line)
            rows[row["model_type"]] = row
    missing = [t for t in model_types if t not in rows]
    if missing and len(model_types) > 1:
        for model_type in missing:
            rows.update({r["model_type"]: r for r in run_batch([model_type], out, timeout)})
    elif missing:
        rows[missing[0]] = {"model_type": missing[0], "status": "failed",
                            "message": "sweep worker crashed or timed out"}
    return [rows[t] for t in model_types]


def run_isolated(model_type: str, out: Path, quick: bool, timeout: int) -> dict:
    """try_one in a subprocess: a crash or hang of one type does not stop the sweep."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", model_type, "--out", str(out / model_type)]
    if quick:
        cmd.append("--quick")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"model_type": model_type, "status": "failed", "message": f"timed out after {timeout}s",
                "seconds": timeout}
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return loads_json(line)
    return {"model_type": model_type, "status": "failed", "seconds": round(time.perf_counter() - start, 1),
            "message": f"sweep worker crashed: {_last_error(proc.stderr)}"}


STATUSES = ("parity", "refused", "hf-fails", "failed")


def summary_table(rows: list[dict]) -> str:
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    testable = counts["parity"] + counts["failed"]
    share = f"{100 * counts['parity'] / testable:.1f} %" if testable else "n/a"
    lines = ["| outcome | types |", "|---|---|",
             f"| migrated with parity | {counts['parity']} |",
             f"| refused (exit 3, reason given) | {counts['refused']} |",
             f"| transformers itself fails on every tiny config, or none stays tiny (not counted) "
             f"| {counts['hf-fails']} |",
             f"| failed | {counts['failed']} |",
             f"| **parity / testable** | **{counts['parity']} / {testable} = {share}** |", ""]
    for status in ("failed", "refused", "hf-fails"):
        chosen = [r for r in rows if r["status"] == status]
        if chosen:
            lines += [f"**{status}**", ""] + [f"- `{r['model_type']}`: {r.get('message', '')}" for r in chosen] + [""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_types", nargs="*")
    parser.add_argument("--all", action="store_true", help="every type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    parser.add_argument("--quick", action="store_true", help="vendor + parity only (no recipe run)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--json", type=Path, help="write the rows as JSON")
    parser.add_argument("--markdown", type=Path, help="write the summary table as Markdown")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per type (default 900)")
    parser.add_argument("--resume", type=Path, help="rows JSON of an interrupted sweep: those types are not run again")
    parser.add_argument("--batch", type=int, default=8, help="--quick: types per worker process (default 8)")
    parser.add_argument("--shard", help="I/N: only every N-th type from the I-th (0-based), to split a sweep")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="archs_"))
    import warnings

    warnings.filterwarnings("ignore")
    if args.one:
        for model_type in args.one.split(","):
            if args.quick:
                row = try_in_process(model_type, out)
            else:
                row = try_one(model_type, out, args.quick)
            print(json.dumps(row), flush=True)
        return 0
    model_types = list(args.model_types)
    if args.all:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        model_types += [t for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) if t not in model_types]
    if args.shard:
        index, count = map(int, args.shard.split("/"))
        model_types = model_types[index::count]
    if not model_types:
        parser.error("name model types or pass --all")
    rows = []
    if args.resume and args.resume.is_file():
        # Settled rows only: a failure or a transformers failure is tried again.
        rows = [r for r in load_json(args.resume)
                if r["model_type"] in model_types and r["status"] in ("parity", "refused")]
    done = {r["model_type"] for r in rows}
    todo = [t for t in model_types if t not in done]
    if args.quick:
        batches = [todo[i:i + args.batch] for i in range(0, len(todo), args.batch)]
    else:
        batches = [[t] for t in todo]
    for batch in batches:
        results = run_batch(batch, out, args.timeout) if args.quick else [run_isolated(batch[0], out, False, args.timeout)]
        for r in results:
            rows.append(r)
            print(f"{r['model_type']:<26} {r['status']:<9} diff={r.get('max_abs_logits_diff')} "
                  f"tokens_equal={r.get('greedy_tokens_equal')} {r.get('seconds', '')}s {r.get('message') or ''}",
                  flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=2))
    rows.sort(key=lambda r: model_types.index(r["model_type"]) if r["model_type"] in model_types else len(model_types))
    table = summary_table(rows)
    print("\n" + table)
    if args.markdown:
        args.markdown.write_text(table)
    return 0 if all(r["status"] != "failed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
