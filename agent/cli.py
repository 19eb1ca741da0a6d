"""`migrator` command line. Errors are one line on stderr with a distinct exit code (README)."""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from agent import errors
from agent.errors import MigratorError

DEVICES = ("auto", "npu", "cuda", "cpu")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="migrator", description="Hugging Face model -> Ascend NPU inference recipe")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="migrate a model, repair a recipe, or regenerate its baseline")
    run.add_argument("target", help="https://huggingface.co/Org/Name, Org/Name, a local HF model dir, or a recipe dir")
    _add_run_options(run)

    demo = sub.add_parser("demo", help="migrate the shipped demo model (or --arch: a tiny random checkpoint) end to end")
    demo.add_argument("--output-dir", default="models", help="where the recipe goes (default: models)")
    demo.add_argument("--arch", help="instead of the shipped trained demo model, build a tiny random "
                                      "checkpoint of this model_type (e.g. qwen3) and migrate it")
    demo.add_argument("--device", choices=DEVICES, default="auto")
    demo.add_argument("--json", action="store_true", help="print a JSON summary on stdout")

    env = sub.add_parser("env", help="print the environment (NPU, CANN, torch/torch_npu, CUDA, CPU)")
    env.add_argument("--json", action="store_true")
    env.add_argument("--device", choices=DEVICES, default="auto",
                     help="fail with exit code 4 if this device is not usable")

    baseline = sub.add_parser("baseline", help="regenerate the baseline of each recipe; write a summary table")
    baseline.add_argument("recipes", nargs="+", help="recipe directories (e.g. models/*)")
    baseline.add_argument("--summary", default="baseline_summary",
                          help="summary path without suffix: writes .md and .csv (default: baseline_summary)")
    baseline.add_argument("--max-rounds", type=int, default=0,
                          help="repair rounds for a failing recipe (default: 0, report only)")
    baseline.add_argument("--timeout", type=int, default=1800, help="seconds for each run of infer.sh")

    rollback = sub.add_parser("rollback", help="restore a recipe's files from before a repair round")
    rollback.add_argument("recipe")
    rollback.add_argument("--round", type=int, help="restore the state before this round (default: the first)")

    classify = sub.add_parser("classify", help="print the scenario (A/B/C) for PATH and why")
    classify.add_argument("path")
    classify.add_argument("--timeout", type=int, default=1800, help="seconds for the trial run of infer.sh")
    return parser


def _add_run_options(run: argparse.ArgumentParser) -> None:
    run.add_argument("--name", help="recipe name (default: derived from the model name)")
    run.add_argument("--output-dir", default="models", help="where new recipes go (default: models)")
    run.add_argument("--device", choices=DEVICES, default="auto", help="device to run on (default: auto)")
    run.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                     help="model dtype in the YAML (default: the checkpoint's)")
    run.add_argument("--weights", help="local weights directory for models too large to download")
    run.add_argument("--trust-remote-code", action="store_true",
                     help="allow vendoring the model repo's own code (auto_map)")
    run.add_argument("--allow-install", action="store_true",
                     help="let repairs pip-install missing packages (otherwise the install line is reported)")
    run.add_argument("--max-rounds", type=int, default=5, help="repair rounds at most (default: 5)")
    run.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per run (default: 32)")
    run.add_argument("--world-size", type=int, default=1, help="cards: run config/NAME_{N}card_eager.yaml with torchrun, "
                     "the model tensor-parallel over them (default: 1)")
    run.add_argument("--timeout", type=int, default=1800, help="seconds for each run of infer.sh")
    run.add_argument("--resume", action="store_true", help="continue an interrupted run from its last finished node")
    run.add_argument("--json", action="store_true", help="print a JSON summary on stdout")


# ---- progress ---------------------------------------------------------------------------
def _progress(name: str, fn):
    """Each node's start, end and elapsed time on stderr; on a terminal the line ticks live."""
    import threading

    @functools.wraps(fn)
    def wrapper(state):
        start = time.perf_counter()
        live = sys.stderr.isatty()
        stop = threading.Event()
        if live:
            def tick():
                while not stop.wait(0.5):
                    print(f"\r[migrator] {name} ... {time.perf_counter() - start:.0f}s", end="", file=sys.stderr,
                          flush=True)
            threading.Thread(target=tick, daemon=True).start()
        else:
            print(f"[migrator] {name} ...", file=sys.stderr, flush=True)
        try:
            result = fn(state)
        except BaseException:
            stop.set()
            if live:
                print(file=sys.stderr)   # keep the error off the progress line
            raise
        stop.set()
        prefix = "\r\033[K" if live else ""
        print(f"{prefix}[migrator] {name} done in {time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
        return result
    return wrapper


def _compiled_graph(checkpoint_db: Path):
    import sqlite3

    from langgraph.checkpoint.sqlite import SqliteSaver

    from agent.graph import build_graph

    graph = build_graph(wrap=_progress)
    checkpoint_db.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(str(checkpoint_db), check_same_thread=False)
    return graph.compile(checkpointer=SqliteSaver(conn))


def run_workflow(state: dict, resume: bool = False) -> dict:
    """Run the graph with a SQLite checkpointer under the output dir (durability "sync": each
    finished node is on disk before the next starts, so a killed run resumes where it was); `resume` continues the
    latest interrupted run of the same target/name/output dir, a fresh run gets a new thread."""
    import uuid

    from agent.nodes import summarise

    output_dir = Path(state.get("output_dir") or "models").resolve()
    target = Path(state["target"]).expanduser()
    key = json.dumps([str(target.resolve()) if target.exists() else state["target"], state.get("name"),
                      str(output_dir)])
    key = hashlib.sha256(key.encode()).hexdigest()[:16]
    # Checkpoints live with what they describe: in the recipe for B/C, in the output dir for A.
    home = target.resolve() if (target / "infer.sh").is_file() else output_dir
    threads_file = home / ".migrator" / "threads.json"
    app = _compiled_graph(home / ".migrator" / "checkpoints.sqlite")
    threads = json.loads(threads_file.read_text()) if threads_file.is_file() else {}
    if resume and key in threads:
        config = {"configurable": {"thread_id": threads[key]}, "recursion_limit": 100}
        snapshot = app.get_state(config)
        if snapshot.next:
            print(f"[migrator] resuming at {', '.join(snapshot.next)}", file=sys.stderr)
            return summarise(app.invoke(None, config, durability="sync"))
        print("[migrator] the last run of this target finished; nothing to resume", file=sys.stderr)
        return summarise(snapshot.values)
    if resume:
        print("[migrator] no interrupted run of this target: starting from the beginning", file=sys.stderr)
    threads[key] = f"{key}-{uuid.uuid4().hex[:8]}"
    threads_file.write_text(json.dumps(threads, indent=2))
    config = {"configurable": {"thread_id": threads[key]}, "recursion_limit": 100}
    return summarise(app.invoke(state, config, durability="sync"))


# ---- commands ---------------------------------------------------------------------------
def check_target(target: str) -> None:
    """Reject bad input before the workflow starts: one line, exit code 2."""
    from agent.acquire import parse_hub_ref

    path = Path(target).expanduser()
    if path.exists():
        if not path.is_dir():
            raise errors.InputError(f"{target}: not a directory; give a Hugging Face model directory, "
                                    "a recipe directory, an https://huggingface.co/Org/Name link or Org/Name")
        if not (path / "config.json").is_file() and not (path / "infer.sh").is_file():
            raise errors.InputError(f"{target}: no config.json — point at a Hugging Face model directory "
                                    "(the folder that holds config.json and the weights) or a recipe with infer.sh")
    elif parse_hub_ref(target) is None:
        raise errors.InputError(f"{target}: no such directory, and not a Hugging Face link "
                                "(https://huggingface.co/Org/Name) or repo id (Org/Name)")


def cmd_run(args) -> int:
    if not args.resume:
        check_target(args.target)
    state = {"target": args.target, "output_dir": args.output_dir, "name": args.name, "device": args.device,
             "dtype": args.dtype, "weights": args.weights, "trust_remote_code": args.trust_remote_code,
             "max_rounds": args.max_rounds, "allow_install": args.allow_install, "timeout_s": args.timeout, "max_new_tokens": args.max_new_tokens,
             "world_size": args.world_size}
    summary = run_workflow(state, resume=args.resume)
    return _finish(summary, args.json)


def _finish(summary: dict, as_json: bool) -> int:
    status = summary.get("status")
    code = {"ok": errors.EXIT_OK, "oom": errors.EXIT_OOM}.get(status, errors.EXIT_FAILED)
    if as_json:
        print(json.dumps(dict(summary, exit_code=code), indent=2))
    else:
        print(f"{status}: {summary.get('recipe_dir')}" + (f" — {summary['message']}" if summary.get("message") else ""))
        if summary.get("baseline_path"):
            print(f"baseline: {summary['baseline_path']}")
    return code


def cmd_demo(args) -> int:
    from agent.tiny_checkpoint import build_tiny_checkpoint

    from agent.paths import demo_model_dir

    output_dir = Path(args.output_dir)
    if args.arch:
        checkpoint = output_dir / ".checkpoints" / f"tiny_{args.arch}"
        name = f"demo_tiny_{args.arch}"
        if not (checkpoint / "config.json").is_file():
            print(f"[migrator] building tiny {args.arch} checkpoint in {checkpoint}", file=sys.stderr)
            build_tiny_checkpoint(args.arch, checkpoint)
    else:
        # Shipped, trained once by scripts/train_demo_model.py: the output is readable text.
        checkpoint = demo_model_dir()
        name = "demo_tiny_attention_llama"
    recipe = output_dir / name
    if recipe.exists():
        # The demo recipe is regenerated each time; the previous one is kept, not deleted.
        previous = recipe.with_name(name + ".previous")
        shutil.rmtree(previous, ignore_errors=True)
        recipe.rename(previous)
    state = {"target": str(checkpoint), "output_dir": str(output_dir), "name": name, "device": args.device,
             "max_rounds": 5, "timeout_s": 900, "max_new_tokens": 32}
    summary = run_workflow(state)
    code = _finish(summary, args.json)
    if code == 0 and not args.json and summary.get("baseline_path"):
        perf = json.loads(Path(summary["baseline_path"]).read_text())["performance"]
        print(f"prefill {perf['prefill_ms']} ms, decode {perf['decode_avg_ms']} ms/token; output: {perf['output_text']!r}")
    return code


def cmd_env(args) -> int:
    from engine.environment import DeviceUnavailableError, detect_environment, select_device

    try:
        env = detect_environment(args.device)
    except DeviceUnavailableError as exc:
        raise errors.EnvironmentProblem(str(exc)) from exc
    if args.json:
        print(json.dumps(env, indent=2))
    else:
        for key, value in env.items():
            print(f"{key:20} {value}")
    if args.device != "auto":
        try:
            select_device(args.device)
        except DeviceUnavailableError as exc:
            raise errors.EnvironmentProblem(str(exc)) from exc
    return 0


def cmd_classify(args) -> int:
    from agent.nodes import node_classify

    path = Path(args.path)
    if not path.exists():
        raise errors.InputError(f"{args.path}: no such file or directory")
    result = node_classify({"target": str(path), "timeout_s": args.timeout})
    print(f"{result['scenario']}: {result['classify_reason']}")
    return 0


SUMMARY_COLUMNS = ["model", "status", "prefill_ms", "decode_avg_ms", "device", "recipe", "message"]


def cmd_baseline(args) -> int:
    """Regenerate baselines one recipe after another; a failure is recorded, not fatal."""
    import csv

    rows = []
    for i, raw in enumerate(args.recipes, 1):
        recipe = Path(raw)
        row = {"model": recipe.name, "recipe": str(recipe), "status": "skipped", "prefill_ms": None,
               "decode_avg_ms": None, "device": None, "message": ""}
        print(f"[migrator] baseline {i}/{len(args.recipes)}: {recipe}", file=sys.stderr, flush=True)
        if not (recipe / "infer.sh").is_file():
            row["message"] = "not a recipe (no infer.sh)"
            rows.append(row)
            continue
        try:
            summary = run_workflow({"target": str(recipe), "output_dir": str(recipe.parent),
                                    "max_rounds": args.max_rounds, "timeout_s": args.timeout, "device": "auto"})
            row.update(status=summary.get("status"), message=summary.get("message", ""))
            if summary.get("baseline_path"):
                data = json.loads(Path(summary["baseline_path"]).read_text())
                row.update(model=data["model_config"]["model_name"], device=data["environment"].get("device"),
                           prefill_ms=data["performance"]["prefill_ms"],
                           decode_avg_ms=data["performance"]["decode_avg_ms"])
        except MigratorError as exc:
            row.update(status="error", message=str(exc))
        rows.append(row)
    summary_path = Path(args.summary)
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    with open(summary_path.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(SUMMARY_COLUMNS[:5]) + " |", "|" + " --- |" * 5]
    for row in rows:
        lines.append("| " + " | ".join("" if row[c] is None else str(row[c]) for c in SUMMARY_COLUMNS[:5]) + " |")
    summary_path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"summary: {summary_path.with_suffix('.md')} and {summary_path.with_suffix('.csv')}")
    return errors.EXIT_OK if all(r["status"] == "ok" for r in rows) else errors.EXIT_FAILED


def cmd_rollback(args) -> int:
    from agent.repair import rollback

    recipe = Path(args.recipe)
    if not recipe.is_dir():
        raise errors.InputError(f"{args.recipe}: no such recipe directory")
    try:
        round_no, changes = rollback(recipe, args.round)
    except FileNotFoundError as exc:
        raise errors.InputError(str(exc)) from exc
    for change in changes:
        print(change)
    print(f"rolled back {recipe} to before repair round {round_no} ({len(changes)} file(s) changed)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from engine.environment import TorchImportError, import_torch

    try:
        import_torch()  # first torch import of the process: guarded against torch_npu without CANN
    except TorchImportError as exc:
        print(f"migrator: error: torch cannot be imported ({exc}); fix the torch installation", file=sys.stderr)
        return errors.EXIT_ENVIRONMENT
    handler = {"run": cmd_run, "demo": cmd_demo, "env": cmd_env, "classify": cmd_classify,
               "rollback": cmd_rollback, "baseline": cmd_baseline}[args.command]
    try:
        return handler(args)
    except MigratorError as exc:
        print(f"migrator: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("migrator: interrupted; continue with --resume", file=sys.stderr)
        return errors.EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
