"""torch_npu ops per decode step, side by side: upstream's own framework model and ours, one checkpoint.

    python scripts/op_table.py --model-type qwen3 --upstream qwen:qwen3_8b_1tp.yaml --out /tmp/optable
    python scripts/op_table.py --model-type gpt_oss --upstream gpt_oss:gpt_oss_20b.yaml --out /tmp/optable_gpt_oss
    .venv-tf5.0/bin/python scripts/op_table.py --model-type deepseek_v3 --set num_key_value_heads=4 \
        --world-size 2 --exe-mode npugraph_ex \
        --upstream deepseek_r1:decode_r1_rank_16_16tp_a8w8.yaml --out /tmp/optable_deepseek
      (deepseek_r1 imports transformers 5.0's modeling_attn_mask_utils, refuses eager with its multi-stream
      settings, and at one rank takes its EP path, which needs more than one rank)

In a copy of the checkout (`--checkout`, default ../shared/upstream/cann-recipes-infer), on one tiny random
checkpoint of `--model-type` (agent.run.standin's --tiny builder, or `--checkpoint`): each
`--upstream MODEL[:YAML]` runs as it is, on a copy of its YAML shrunk as `migrator run --standin --tiny`
shrinks it; and (unless `--no-ours`) the checkpoint is migrated into the copy's models/ by the framework
target and run the same way. Every column runs through upstream's launcher (`executor/scripts/infer.sh
--model M --yaml F`) under the npu stand-in, in `--exe-mode` (eager by default), and its counts are the
stand-in's record of that run (npu_standin.record: per step, per decoder layer; warm-up and MTP calls are
not steps). Writes op_table.md and op_table.json in --out and prints the table.

A compiled decode step (npugraph_ex / ge_graph) runs its ops inside a captured graph where no layer hook
runs: its calls are counted as the graph runs them, none per layer (the table says so).

Exit codes: 0 every column ran, 1 a column's run failed (the table still written, that column marked),
2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from engine.safe_load import load_json, loads_json  # noqa: E402 - after the checkout is on sys.path

# the project's checkout sits beside ../shared; a worktree of it one level further down
DEFAULT_CHECKOUT = next((root / "shared" / "upstream" / "cann-recipes-infer" for root in (REPO.parent, REPO.parent.parent)
                         if (root / "shared" / "upstream" / "cann-recipes-infer").is_dir()),
                        REPO.parent / "shared" / "upstream" / "cann-recipes-infer")
EXE_MODES = ("eager", "npugraph_ex", "ge_graph")
OURS_NAME = "optable_ours"
# Explanations of a row's difference, keyed by op: the caller's words. The counts never come from here.
# Why an op is on one side only (a row whose counts differ gets its explanation; the counts always come
# from the runs). Keyed by op.
KNOWN_DIFFERENCES: dict[str, str] = {
    "npu_swiglu": "ours fuses the MLP's silu(gate) * up into npu_swiglu (the fusion stage, upstream's "
                  "model-infer-fusion skill); upstream's models/qwen computes ACT2FN[silu](gate) * up in plain torch "
                  "(QwenMLP._forward_normal), so the op is ours alone",
    # upstream's models/gpt_oss routes with the first routing API; ours with the second, as upstream's
    # newer MoE models (module/fuse_moe_gmm.py's callers: qwen3_moe's moe_infer_tp, deepseek_r1) do
    "npu_moe_init_routing": "upstream's models/gpt_oss permutes tokens with the v1 op (GptOssMLP.moe_infer_fusion: "
                            "npu_moe_init_routing on the gating's row_idx, then npu_moe_compute_expert_tokens for "
                            "each expert's cumulative end row); ours calls npu_moe_init_routing_v2, which returns "
                            "the per-expert token counts itself (expert_tokens_num_type 1) as upstream's qwen3_moe "
                            "routes: one op for upstream's two, the same grouped matmuls after it",
    "npu_moe_compute_expert_tokens": "upstream's gpt_oss counts each expert's tokens after its v1 routing op; "
                                     "ours has npu_moe_init_routing_v2 return the counts (see npu_moe_init_routing)",
    "npu_moe_init_routing_v2": "ours routes with the v2 op (per-expert counts included, finalize_routing in its "
                               "drop_pad_mode 2 row order); upstream's gpt_oss with npu_moe_init_routing + "
                               "npu_moe_compute_expert_tokens (see npu_moe_init_routing)",
}


# ---- the table, from the runs' records (pure) --------------------------------------------------
def column_counts(usage: dict | None) -> dict:
    """One run's steps: the first rank's (lowest) process that has steps. {"rank", "decode_steps",
    "prefill_steps", "excluded", "compiled", "layers", "exe_mode", "decode": {op: [calls per decode
    step]}, "prefill": {op: [calls per prefill step]}, "per_layer": {op: [[calls per layer], ..]} (one
    list per distinct decode step), "outside_layers": {op: [distinct calls outside the layers]}}; None
    without any step in the record."""
    processes = [p for p in (usage or {}).get("per_process") or [] if p.get("steps")]
    if not processes:
        return None
    process = min(processes, key=lambda p: (p.get("rank") is None, p.get("rank") or 0))
    groups = process["steps"]
    decode = [g for g in groups if g.get("phase") == "decode"]
    prefill = [g for g in groups if g.get("phase") == "prefill"]
    steps = sorted(((n, g) for g in decode for n in g.get("steps") or []), key=lambda item: item[0])
    per_step: dict[str, list[int]] = {}
    names = sorted({name for g in decode for name in g.get("ops") or {}})
    for name in names:
        per_step[name] = [(g.get("ops") or {}).get(name, 0) for _, g in steps]
    layered = [g for g in decode if g.get("per_layer") is not None]
    per_layer: dict[str, list] = {}
    outside: dict[str, list] = {}
    for name in names:
        shapes = {json.dumps((g.get("per_layer") or {}).get(name, [0] * (g.get("layers") or 0))) for g in layered}
        per_layer[name] = [loads_json(s) for s in sorted(shapes)]
        outside[name] = sorted({(g.get("outside_layers") or {}).get(name, 0) for g in layered})
    prefill_ops = sorted({name for g in prefill for name in g.get("ops") or {}})
    return {"rank": process.get("rank"), "decode_steps": len(steps),
            "prefill": {name: [(g.get("ops") or {}).get(name, 0) for g in prefill for _ in g.get("steps") or []]
                        for name in prefill_ops},
            "prefill_steps": sum(len(g.get("steps") or []) for g in prefill),
            "excluded": process.get("steps_excluded") or {},
            "compiled": any(g.get("compiled") for g in decode),
            "exe_mode": next((g.get("exe_mode") for g in groups if g.get("exe_mode")), None),
            "layers": next((g.get("layers") for g in layered if g.get("layers")), None),
            "decode": per_step, "per_layer": per_layer, "outside_layers": outside}


def _calls_cell(calls: list[int] | None) -> str:
    if not calls:
        return "—"
    low, high = min(calls), max(calls)
    return str(low) if low == high else f"{low}–{high}"


def _layer_cell(counts: dict, name: str) -> str:
    if name not in counts["decode"]:
        return "—"
    if counts["compiled"]:
        return "n/a (compiled step)"
    shapes = counts["per_layer"].get(name) or []
    if not counts["layers"] or not shapes:
        return "n/a (no layers found)"
    parts = []
    for shape in shapes:
        parts.append(str(shape[0]) if len(set(shape)) == 1 else "[" + ",".join(map(str, shape)) + "]")
    cell = " / ".join(parts)
    outside = [n for n in counts["outside_layers"].get(name) or [] if n]
    if outside:
        cell += f" + {'/'.join(map(str, outside))} outside layers"
    return cell


def build_table(columns: list[dict], explanations: dict[str, str] | None = None) -> dict:
    """`columns`: [{"label", "usage" (a merged stand-in record), ...}] -> {"columns": [... with "counts"],
    "rows": [{"op", "cells": {label: {"calls_per_decode_step", "per_layer"}}, "difference"}]}: a row for
    every op of a decode step of any column."""
    explanations = KNOWN_DIFFERENCES if explanations is None else explanations
    out_columns = []
    for column in columns:
        counts = column_counts(column.get("usage"))
        out_columns.append({**{k: v for k, v in column.items() if k != "usage"}, "counts": counts})
    names = sorted({name for c in out_columns if c["counts"] for name in c["counts"]["decode"]})
    rows = []
    for name in names:
        cells = {}
        for c in out_columns:
            counts = c["counts"]
            if counts is None:
                cells[c["label"]] = {"calls_per_decode_step": None, "per_layer": None}
                continue
            calls = counts["decode"].get(name)
            cells[c["label"]] = {"calls_per_decode_step": _calls_cell(calls), "calls": calls,
                                 "per_layer": _layer_cell(counts, name)}
        present = [bool(c["counts"] and name in c["counts"]["decode"]) for c in out_columns]
        same = len({cells[c["label"]]["calls_per_decode_step"] for c in out_columns}) == 1
        # an explanation is for a row whose counts differ; a row the same on every side says so
        difference = "" if same else (explanations.get(name) or (
            "only in " + ", ".join(c["label"] for c, p in zip(out_columns, present) if p) if not all(present) else ""))
        rows.append({"op": name, "cells": cells, "same": same, "difference": difference})
    return {"columns": out_columns, "rows": rows}


def markdown(table: dict) -> str:
    columns = table["columns"]
    head = ["op"]
    for c in columns:
        layers = (c["counts"] or {}).get("layers")
        head += [f"{c['label']}: calls/decode step", f"{c['label']}: per layer" + (f" (×{layers})" if layers else "")]
    head.append("difference")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table["rows"]:
        cells = [f"`{row['op']}`"]
        for c in columns:
            cell = row["cells"][c["label"]]
            cells += [cell["calls_per_decode_step"] or "run failed", cell["per_layer"] or "run failed"]
        cells.append(row["difference"] or ("same" if row["same"] else ""))
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    for c in columns:
        counts = c["counts"]
        if counts is None:
            error = f"; it ends: {c['error']}" if c.get("error") else ""
            notes.append(f"- {c['label']}: no steps in the stand-in's record (launcher exit {c.get('returncode')}"
                         f"{error}; log: {c.get('log')})")
            continue
        excluded = ", ".join(f"{n} {k}" for k, n in sorted(counts["excluded"].items())) or "none"
        notes.append(f"- {c['label']}: models/{c['model']} with {c['yaml']}, exe_mode {counts['exe_mode']}"
                     f"{' (decode compiled: counts as the captured graph ran them, no per-layer split)' if counts['compiled'] else ''}"
                     f"; rank {counts['rank']}: {counts['prefill_steps']} prefill, {counts['decode_steps']} decode "
                     f"step(s) counted, calls left out: {excluded}; exit {c.get('returncode')}")
    if table.get("ours_custom_params"):
        notes.append(f"- ours: model_config.custom_params {json.dumps(table['ours_custom_params'])} in its YAML")
    if not table["rows"]:
        notes.append("- no torch_npu op ran in any decode step")
    return "\n".join(lines + [""] + notes) + "\n"


# ---- the runs -------------------------------------------------------------------------------
def tiny_checkpoint(model_type: str, out: Path, layers: int | None = None, overrides: dict | None = None) -> Path:
    from agent.run.standin import TINY_SETTINGS
    from agent.measure.reference import tiny_checkpoint as build

    if out.exists():
        shutil.rmtree(out)
    settings = {**TINY_SETTINGS.get(model_type, {}), **(overrides or {})}
    if layers:
        settings["num_hidden_layers"] = layers
    return build(model_type, out, **settings)


def shrunk_yaml(recipe_dir: Path, yaml_name: str | None, checkpoint: Path, exe_mode: str,
                max_new_tokens: int, world_size: int = 1, custom_params: dict | None = None) -> str:
    """config/optable_<yaml> in the recipe: its YAML on `checkpoint` at `world_size` ranks, lengths and batch cut as
    `migrator run --standin --tiny` cuts them, in `exe_mode`, `custom_params` set in model_config. Returns its name."""
    import yaml

    from agent.recipe.recipe import Recipe, RunPlan
    from agent.run.plan import copy_path, write_copy
    from engine.safe_load import load_yaml

    recipe = Recipe.at(recipe_dir)
    source = recipe_dir / "config" / yaml_name if yaml_name else recipe.yaml
    plan = RunPlan(copy_path(recipe, source, standin=True), world_size, source_yaml=source, checkpoint=checkpoint,
                   standin="cpu", tiny=True, max_new_tokens=max_new_tokens)
    data = load_yaml(write_copy(recipe, plan)) or {}
    data.setdefault("model_config", {})["exe_mode"] = exe_mode
    if custom_params:
        data["model_config"].setdefault("custom_params", {}).update(custom_params)
    name = f"optable_{source.stem}_{exe_mode}_{world_size}rank.yaml"
    (recipe_dir / "config" / name).write_text(yaml.safe_dump(data, sort_keys=False))
    return name


def run_column(checkout: Path, model: str, yaml_name: str, record: Path, timeout: float, compile_mode: str) -> dict:
    from agent.measure import reference as upstream
    from npu_standin import launcher

    if record.exists():
        shutil.rmtree(record)
    result = launcher.run(upstream.framework_command(checkout, model, yaml_name), record_dir=record, cwd=checkout,
                          timeout=timeout, compile_mode=compile_mode)
    logs = upstream.rank_logs(checkout, model, yaml_name)
    return {"usage": result.usage, "returncode": result.returncode, "error": last_error(logs[0]) if logs else None,
            "log": str(logs[0]) if logs else None, "record": str(record / launcher.USAGE_FILE)}


ERROR_LINE = re.compile(r"^(?:\[rank\d+\]: )?((?:[\w.]+Error|[\w.]+Exception|UnsupportedOp): .*)$", re.M)


def last_error(log: Path) -> str | None:
    """The last exception line of a rank's log (upstream's launcher may exit 0 when a rank failed)."""
    try:
        found = ERROR_LINE.findall(log.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None
    return found[-1][:300] if found else None


def migrate_ours(checkout: Path, checkpoint: Path, name: str) -> Path:
    from agent.workflow.run import run_migration

    run_migration({"target": str(checkpoint), "output_dir": str(checkout / "models"), "name": name, "device": "cpu",
                   "max_new_tokens": 8, "max_rounds": 0, "world_size": 1, "recipe_target": "framework",
                   "transformers_source": "installed"}, stop_after="render")
    return checkout / "models" / name


def _upstream_spec(text: str) -> tuple[str, str | None]:
    model, _, yaml_name = text.partition(":")
    return model, yaml_name or None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-type", help="a tiny random checkpoint of this transformers model_type (qwen3, ...)")
    parser.add_argument("--checkpoint", help="instead of --model-type: this checkpoint")
    parser.add_argument("--upstream", action="append", default=[], metavar="MODEL[:YAML]",
                        help="an upstream models/MODEL column, its YAML under config/ (default: the recipe's); repeatable")
    parser.add_argument("--no-ours", dest="ours", action="store_false",
                        help="no column of our framework model of the checkpoint")
    parser.add_argument("--explanations", help="a JSON file {op: why the columns differ} for the difference column "
                                               "(default: KNOWN_DIFFERENCES in this script)")
    parser.add_argument("--checkout", default=str(DEFAULT_CHECKOUT), help="the cann-recipes-infer checkout to copy")
    parser.add_argument("--exe-mode", default="eager", choices=EXE_MODES, help="every column's exe_mode (default eager)")
    parser.add_argument("--compile", default="auto", choices=("auto", "inductor", "capture", "off"),
                        help="how the stand-in compiles a graph-mode decode (NPU_STANDIN_COMPILE; default auto)")
    parser.add_argument("--num-layers", type=int, help="with --model-type: the tiny checkpoint's decoder layers")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="with --model-type: a config value of the tiny checkpoint (as the published model has "
                             "it, e.g. num_key_value_heads=4 for deepseek_v3's MLA); repeatable")
    parser.add_argument("--ours-custom-param", action="append", default=[], metavar="KEY=JSON",
                        help="a model_config.custom_params value of our recipe's YAML only (e.g. enable_mla_prolog=true, "
                             "as upstream's deepseek_r1 YAMLs set it); repeatable")
    parser.add_argument("--world-size", type=int, default=1,
                        help="ranks of every column (its YAML's parallel_config scaled as --standin --tiny does); "
                             "the table shows the lowest rank's calls")
    parser.add_argument("--max-new-tokens", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per column run")
    parser.add_argument("--out", required=True, help="folder for op_table.md / op_table.json and the runs")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    source = Path(args.checkout).expanduser()
    if not (source / "executor" / "scripts" / "infer.sh").is_file():
        print(f"op_table: --checkout {args.checkout}: not a cann-recipes-infer checkout (no executor/scripts/infer.sh)",
              file=sys.stderr)
        return 2
    if bool(args.model_type) == bool(args.checkpoint):
        print("op_table: give one of --model-type TYPE (a tiny random checkpoint) or --checkpoint PATH", file=sys.stderr)
        return 2
    if not args.upstream and not args.ours:
        print("op_table: nothing to compare: give --upstream MODEL[:YAML] and/or leave --ours on", file=sys.stderr)
        return 2
    specs = [_upstream_spec(s) for s in args.upstream]
    for model, yaml_name in specs:
        config = source / "models" / model / "config"
        if not config.is_dir() or (yaml_name and not (config / yaml_name).is_file()):
            print(f"op_table: --upstream {model}{':' + yaml_name if yaml_name else ''}: no such model folder or YAML "
                  f"in {source / 'models'}", file=sys.stderr)
            return 2
    if args.num_layers is not None and (args.num_layers < 1 or args.checkpoint):
        print("op_table: --num-layers takes a positive count, with --model-type only", file=sys.stderr)
        return 2
    settings = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        try:
            settings[key] = loads_json(value, f"--set {key}")
        except ValueError:
            settings[key] = value
        if not sep or not key.isidentifier() or args.checkpoint:
            print(f"op_table: --set {item}: want KEY=VALUE (a config field), with --model-type only", file=sys.stderr)
            return 2
    if args.world_size < 1:
        print("op_table: --world-size takes a positive count", file=sys.stderr)
        return 2
    ours_params = {}
    for item in args.ours_custom_param:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier() or not args.ours:
            print(f"op_table: --ours-custom-param {item}: want KEY=VALUE (a custom_params field), with our column",
                  file=sys.stderr)
            return 2
        try:
            ours_params[key] = loads_json(value, f"--ours-custom-param {key}")
        except ValueError:
            ours_params[key] = value
    if args.max_new_tokens < 2:
        print("op_table: --max-new-tokens must be at least 2 (one decode step)", file=sys.stderr)
        return 2
    explanations = None
    if args.explanations:
        try:
            explanations = load_json(Path(args.explanations).expanduser())
        except (OSError, ValueError) as exc:
            print(f"op_table: --explanations {args.explanations}: not a readable JSON file ({exc})", file=sys.stderr)
            return 2
        if not isinstance(explanations, dict) or not all(isinstance(v, str) for v in explanations.values()):
            print(f"op_table: --explanations {args.explanations}: want a JSON object {{op: text}}", file=sys.stderr)
            return 2
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    checkout = out / "cann-recipes-infer"
    if checkout.exists():
        shutil.rmtree(checkout)
    shutil.copytree(source, checkout, ignore=shutil.ignore_patterns("res", ".git"))
    for path in [checkout, *checkout.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o200)
    if args.checkpoint:
        checkpoint = Path(args.checkpoint).expanduser().resolve()
        if not (checkpoint / "config.json").is_file():
            print(f"op_table: --checkpoint {args.checkpoint}: no config.json there", file=sys.stderr)
            return 2
    else:
        checkpoint = tiny_checkpoint(args.model_type, out / f"tiny_{args.model_type}", args.num_layers, settings)

    plan = [(f"upstream {model}", model, yaml_name) for model, yaml_name in specs]
    if args.ours:
        print(f"[op_table] migrating {checkpoint} into {checkout / 'models'} (framework target)", file=sys.stderr)
        migrate_ours(checkout, checkpoint, OURS_NAME)
        plan.append(("ours", OURS_NAME, None))
    columns = []
    for label, model, yaml_name in plan:
        shrunk = shrunk_yaml(checkout / "models" / model, yaml_name, checkpoint, args.exe_mode, args.max_new_tokens,
                             args.world_size, ours_params if model == OURS_NAME else None)
        print(f"[op_table] {label}: infer.sh --model {model} --yaml {shrunk} under the npu stand-in", file=sys.stderr)
        run = run_column(checkout, model, shrunk, out / "records" / model, args.timeout, args.compile)
        columns.append({"label": label, "model": model, "yaml": shrunk, **run})
    table = build_table(columns, explanations)
    table.update(checkpoint=str(checkpoint), model_type=args.model_type, exe_mode=args.exe_mode, compile=args.compile,
                 world_size=args.world_size, ours_custom_params=ours_params,
                 checkout=str(source), max_new_tokens=args.max_new_tokens)
    text = markdown(table)
    (out / "op_table.md").write_text(text)
    (out / "op_table.json").write_text(json.dumps(table, indent=1) + "\n")
    print(text)
    print(f"[op_table] {out / 'op_table.md'}, {out / 'op_table.json'}", file=sys.stderr)
    return 0 if all(c.get("returncode") == 0 and c["counts"] for c in table["columns"]) else 1


if __name__ == "__main__":
    sys.exit(main())
