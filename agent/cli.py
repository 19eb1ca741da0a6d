"""`migrator` command line. Errors are one line on stderr with a distinct exit code (README.md, docs/exit-codes.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from agent import errors
from agent.errors import MigratorError
from agent.paths import demo_model_dir
from agent.recipe.backup import has_backups, rollback
from agent.recipe.fs_guard import parent_tree, user_tree
from agent.recipe.recipe import Recipe
from agent.processes import Terminated, install_signal_handlers
from agent.recipe.targets import TARGETS
from agent.workflow import inputs
from agent.workflow.run import run_migration
from engine import defaults
from engine.config import KEY
from engine.environment import DeviceUnavailableError, TorchImportError, import_torch, select_device
from engine.safe_load import LoadError, load_json
from engine.safe_write import WriteRefused

DEVICES = KEY["device"].choices


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line too (argparse prints the whole usage block first)."""

    def error(self, message):
        _USAGE_ERRORS.append(f"{message}; see `{self.prog} --help`")
        self.exit(errors.EXIT_USAGE, f"migrator: error: {_USAGE_ERRORS[-1]}\n")


_USAGE_ERRORS: list[str] = []      # the line a usage error printed (for --json)


def _bounded_int(low: int, high: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range ({low} .. {high})")
        return value
    return parse


ROUNDS = _bounded_int(0, defaults.MAX_ROUNDS_LIMIT)
TIMEOUT = _bounded_int(1, 7 * 24 * 3600)
NEW_TOKENS = _bounded_int(1, 65536)
WORLD_SIZE = _bounded_int(1, 4096)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="migrator", description="Hugging Face model -> Ascend NPU inference recipe")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    run = sub.add_parser("run", help="migrate a model, repair a recipe, or regenerate its baseline")
    run.add_argument("target", help="https://huggingface.co/Org/Name, Org/Name, https://modelscope.cn/models/Org/Name, "
                                    "a local HF model dir, or a recipe dir")
    _add_run_options(run)

    demo = sub.add_parser("demo", help="migrate the shipped demo model (or --arch: a tiny random checkpoint) end to end")
    demo.add_argument("--output-dir", default="models", help="where the recipe goes (default: models)")
    demo.add_argument("--arch", help="instead of the shipped trained demo model, build a tiny random "
                                      "checkpoint of this model_type (e.g. qwen3) and migrate it")
    demo.add_argument("--device", choices=DEVICES, default="auto",
                      help="device the demo recipe runs on (default: auto: npu, else cuda, else cpu)")
    demo.add_argument("--json", action="store_true", help="print a JSON summary on stdout")

    env = sub.add_parser("env", help="print the environment (NPU, CANN, torch/torch_npu, CUDA, CPU)")
    env.add_argument("--json", action="store_true", help="print the environment as one JSON object on stdout")
    env.add_argument("--device", choices=DEVICES, default="auto",
                     help="fail with exit code 4 if this device is not usable")

    baseline = sub.add_parser("baseline", help="regenerate the baseline of each recipe; write a summary table")
    baseline.add_argument("recipes", nargs="+", help="recipe directories (e.g. models/*)")
    baseline.add_argument("--summary", default="baseline_summary",
                          help="summary path without suffix: writes .md and .csv (default: baseline_summary)")
    baseline.add_argument("--max-rounds", type=ROUNDS, default=0,
                          help="repair rounds for a failing recipe (default: 0, report only)")
    baseline.add_argument("--timeout", type=TIMEOUT, default=defaults.TIMEOUT_S, help="seconds for each run of infer.sh")
    _add_standin_options(baseline)

    rollback = sub.add_parser("rollback", help="undo the repair rounds of a recipe's latest run, once (and a "
                                               "framework recipe's registry line)")
    rollback.add_argument("recipe", help="the recipe directory whose automatic repairs to undo (a framework "
                                         "recipe: also its line in the checkout's executor/core/support_models.py)")
    rollback.add_argument("--round", type=int, help="restore the state before this round of the latest run "
                                                    "(default: its first)")
    rollback.add_argument("--force", action="store_true",
                          help="roll back over files changed since the repair wrote them (they go to the trash)")

    standin = sub.add_parser("standin", help="run a command with the NPU stand-in: npu on the cpu or a CUDA card, "
                                             "torch_npu kernels as reference implementations (validation, not an NPU)")
    standin.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="host device the npu lands on")
    standin.add_argument("--record", metavar="DIR", help="keep the per-process records and standin_usage.json here")
    standin.add_argument("--compile", choices=("auto", "inductor", "capture", "off"), default="auto",
                         help="what torchair / npugraph_ex graph mode compiles with (default: inductor where the "
                              "host can, else the captured graph eagerly)")
    standin.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command and its arguments")

    convert = sub.add_parser("convert", help="dequantize a quantized checkpoint (fp8, mxfp4, awq, gptq, "
                                             "compressed-tensors) into a bf16 checkpoint, one shard at a time (what "
                                             "`run` does at migration for what the NPU cannot compute)")
    convert.add_argument("source", help="the quantized checkpoint folder")
    convert.add_argument("dest", help="the folder to write (new, or empty; never inside the source)")
    convert.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                         help="the converted weights' dtype (default: bfloat16)")
    convert.add_argument("--without-remote-code", action="store_true",
                         help="write config.json / tokenizer_config.json without auto_map (what a migration without "
                              "--trust-remote-code runs: upstream's launcher would run the repo's code)")

    classify = sub.add_parser("classify", help="print the scenario (A/B/C) for PATH and why")
    classify.add_argument("path", help="a checkpoint folder (A) or a recipe directory, which is run once: "
                                       "B when it fails, C when it runs")
    classify.add_argument("--timeout", type=TIMEOUT, default=defaults.TIMEOUT_S, help="seconds for the trial run of infer.sh")
    return parser


def _add_run_options(run: argparse.ArgumentParser) -> None:
    run.add_argument("--name", help="recipe name (default: derived from the model name)")
    run.add_argument("--output-dir", default="models", help="where new recipes go (default: models)")
    run.add_argument("--target", dest="recipe_target", choices=tuple(TARGETS),
                     help="what kind of recipe to write: framework (models/NAME registered in the checkout's "
                          "executor/core/support_models.py, run by executor/scripts/infer.sh), legacy, or standalone "
                          "(its own infer.sh on this tool's engine); default: framework when --output-dir lies in a "
                          "cann-recipes-infer checkout, else standalone")
    run.add_argument("--transformers-source", metavar="WHEEL|DIR",
                     help="the transformers release a recipe for a checkout is vendored from when it is not the "
                          "installed one (default: the checkout's pin, fetched with pip download): a wheel, or a "
                          "folder holding transformers/ (an unpacked wheel, a venv's site-packages); `installed`: "
                          "the installed release whatever the checkout pins")
    run.add_argument("--reference-python", metavar="PY",
                     help="an interpreter with that transformers (e.g. the checkout's launcher environment): the "
                          "recipe's trial runs and the parity reference run in it (default: python3 on PATH when "
                          "it has the pinned release)")
    run.add_argument("--device", choices=DEVICES, default="auto", help="device to run on (default: auto)")
    run.add_argument("--dtype", choices=KEY["model_config.dtype"].choices,
                     help="model dtype in the YAML (default: the checkpoint's)")
    run.add_argument("--weights", help="local weights directory for models too large to download")
    run.add_argument("--quantize", choices=("w8a8",),
                     help="migrate the checkpoint written as int8 W8A8 (compressed-tensors: int8 weights per "
                          "channel, int8 activations per token at run time, no calibration data; the output head, "
                          "router gates and norms stay float) beside the recipe's state, and report the cost of "
                          "quantizing (top-1 agreement, NLL against the float original)")
    run.add_argument("--hub", choices=("hf", "modelscope"),
                     help="where Org/Name lives (default: hf; a modelscope.cn link says it itself)")
    run.add_argument("--trust-remote-code", action="store_true",
                     help="allow vendoring the model repo's own code (auto_map)")
    run.add_argument("--apply-llm-patches", action="store_true",
                     help="apply the optional LLM repairer's diffs when they change only files the failure's "
                          "traceback names (default: keep them as proposals in .migrator/llm/)")
    run.add_argument("--allow-install", action="store_true",
                     help="let repairs pip-install missing packages (otherwise the install line is reported)")
    run.add_argument("--max-rounds", type=ROUNDS, default=defaults.MAX_ROUNDS,
                     help=f"repair rounds at most, 0 .. {defaults.MAX_ROUNDS_LIMIT} (default: {defaults.MAX_ROUNDS})")
    run.add_argument("--max-new-tokens", type=NEW_TOKENS, default=defaults.MAX_NEW_TOKENS,
                     help=f"tokens generated per run (default: {defaults.MAX_NEW_TOKENS})")
    run.add_argument("--world-size", type=WORLD_SIZE, default=None,
                     help="ranks: run the recipe's N-rank YAML on N ranks (written from the single-card one when "
                          "it has none), the model tensor-parallel over them, or refuse (exit 2) when the recipe "
                          "cannot run one (default: a new recipe's single card, an existing recipe's own YAML)")
    run.add_argument("--timeout", type=TIMEOUT, default=defaults.TIMEOUT_S, help="seconds for each run of infer.sh")
    run.add_argument("--resume", action="store_true", help="continue an interrupted run from its last finished node")
    _add_standin_options(run)
    run.add_argument("--yaml", help="a cann-recipes-infer recipe's YAML to run (a file in its config/; default: "
                                    "the one for --world-size ranks)")
    run.add_argument("--json", action="store_true", help="print a JSON summary on stdout")


def _add_standin_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--standin", action="store_true",
                        help="run a cann-recipes-infer recipe off an NPU under the npu stand-in (npu on the cpu, "
                             "torch_npu kernels as reference implementations) and check it against transformers")
    parser.add_argument("--tiny", action="store_true",
                        help="with --standin, where the YAML's model_path is not here: a tiny random checkpoint of "
                             "the recipe's architecture, run through a copy of the YAML")


# ---- commands ---------------------------------------------------------------------------
def cmd_run(args) -> int:
    if args.apply_llm_patches:
        from agent.repair.llm_repair import APPLY_ENV

        os.environ[APPLY_ENV] = "1"     # read by the LLM repairer in this process; children never need it
    state, options = inputs.validate_run(args)
    summary = run_migration(state, resume=args.resume, options=options)
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
    from agent.testing.tiny_checkpoint import build_tiny_checkpoint   # a fixture: loaded for --arch only

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
        output_tree = user_tree(output_dir, "the output folder")
        output_tree.rmtree(previous)
        output_tree.replace(recipe, previous)
    state = {"target": str(checkpoint), "output_dir": str(output_dir), "name": name,
             "max_new_tokens": defaults.MAX_NEW_TOKENS}
    summary = run_migration(state, options={"max_rounds": defaults.MAX_ROUNDS, "timeout_s": defaults.DEMO_TIMEOUT_S,
                                            "device": args.device})
    code = _finish(summary, args.json)
    if code == 0 and not args.json and summary.get("baseline_path"):
        perf = load_json(Path(summary["baseline_path"]))["performance"]
        print(f"prefill {perf['prefill_ms']} ms, decode {perf['decode_avg_ms']} ms/token; output: {perf['output_text']!r}")
    return code


def cmd_env(args) -> int:
    from agent.workflow.inputs import host_environment

    env = host_environment(args.device)
    problem = None
    if args.device != "auto":
        try:
            select_device(args.device)
        except DeviceUnavailableError as exc:
            problem = errors.EnvironmentProblem(str(exc))
    if args.json:
        # one object: the environment, and the device problem with its exit code when there is one
        extra = {"status": "error", "exit_code": problem.exit_code, "error": _one_line(str(problem))} if problem else {}
        print(json.dumps({**env, **extra}, indent=2))
        if problem:
            print(f"migrator: error: {_one_line(str(problem))}", file=sys.stderr)
            return problem.exit_code
    else:
        for key, value in env.items():
            print(f"{key:20} {value}")
    if problem:
        raise problem
    return 0


def cmd_standin(args) -> int:
    """Run COMMAND under the NPU stand-in; its exit code, or 8 when it called an op without a reference."""
    from npu_standin import launcher

    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        raise errors.InputError("no command: migrator standin [--device cpu|cuda] -- COMMAND [ARGS...]")
    if args.record:
        inputs.check_text_args(**{"--record": args.record})
        record = Path(args.record).expanduser()
        if record.exists() and not record.is_dir():
            raise errors.InputError(f"--record {args.record}: exists and is not a directory")
    try:
        # the user's command goes with this process, even when a SIGKILL ends it (a `migrator run` in it
        # stops its own tree on the SIGTERM and keeps its state for --resume)
        result = launcher.run(command, device=args.device, record_dir=args.record, compile_mode=args.compile,
                              dies_with_caller=True)
    except launcher.StandinRefused as exc:
        raise errors.EnvironmentProblem(str(exc)) from None
    except (FileNotFoundError, PermissionError) as exc:
        raise errors.InputError(str(exc)) from None
    launcher.main_summary(result, args.device)
    if args.record and result.usage is not None:
        print(f"[npu-standin] record: {Path(args.record) / launcher.USAGE_FILE}", file=sys.stderr)
    uncovered = launcher.first_unsupported(result)
    if uncovered:
        print(f"migrator: error: {uncovered}", file=sys.stderr)
        return errors.EXIT_STANDIN_UNCOVERED
    return result.returncode


def cmd_convert(args) -> int:
    """`migrator convert SRC DEST`: the conversion a migration does (agent.migrate.convert), by hand."""
    from agent.migrate.checkpoint_check import check_config, check_output_outside, check_weights, read_json_file
    from agent.migrate.convert import convert_checkpoint
    from agent.migrate.quantization import check_quantized
    from agent.recipe.fs_guard import user_tree

    inputs.check_text_args(source=args.source, dest=args.dest)
    source, dest = Path(args.source).expanduser(), Path(args.dest).expanduser()
    if not (source / "config.json").is_file():
        raise errors.InputError(f"{args.source}: no config.json — point at the quantized checkpoint's folder")
    check_output_outside(source, dest, args.dest)
    # what a conversion reads: the config, whole weight files, every tensor accounted for (its refusals as in
    # run); the architecture's code and the tokenizer are the migration's business, nothing here runs them
    config = check_config(read_json_file(source / "config.json"), str(source / "config.json"))
    check_weights(source)
    if check_quantized(source, config, (config.get("architectures") or [config["model_type"]])[0]) is None:
        raise errors.InputError(f"{args.source}: config.json has no quantization_config; nothing to convert")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise errors.InputError(f"{args.dest}: exists and is not an empty folder; choose a new folder")
    dest = dest.resolve()
    record = convert_checkpoint(source.resolve(), dest, user_tree(dest.parent, "the destination's folder", create=True),
                                args.dtype, trust_remote_code=not args.without_remote_code)
    peak = (record["peak_rss_bytes"] - record["rss_before_bytes"]) / 2**20
    print(f"{record['format']} -> {record['dtype']}: {record['tensors']['quantized']} tensors dequantized, "
          f"{record['tensors']['kept']} kept, in {record['seconds']} s (peak memory +{peak:.0f} MiB): {dest}")
    return 0


def cmd_classify(args) -> int:
    from agent.workflow.nodes import node_classify   # loads every node's modules: only for this command

    path = Path(args.path).expanduser()
    if not path.exists():
        raise errors.InputError(f"{args.path}: no such file or directory")
    found = Recipe.at(path.resolve())
    state, options = inputs.validate_recipe(found, args)  # refusal: the line run and baseline give
    from agent import folder_lock

    # a recipe is classified by running it, which writes its run folder: never beside another writer
    with folder_lock.holding(found.path, "classify it") if found.is_recipe else contextlib.nullcontext():
        result = node_classify(state, {"configurable": options})
    print(f"{result['scenario']}: {result['classify_reason']}")
    return 0


SUMMARY_COLUMNS = ["model", "status", "prefill_ms", "decode_avg_ms", "device", "recipe", "message"]


def cmd_baseline(args) -> int:
    """Regenerate baselines one recipe after another; a failure is recorded, not fatal. The exit code is
    the class of what went wrong: 1 when a recipe ran and failed, else the one code every other row shares
    (2 not a recipe or a bad file in it, 4 needs an NPU, 74 unwritable, 75 another command holds it), each
    such row also one `migrator: error:` line."""
    import csv

    rows = []
    for i, raw in enumerate(args.recipes, 1):
        recipe = Path(raw).expanduser().resolve()
        row = {"model": recipe.name, "recipe": raw, "status": "skipped", "prefill_ms": None,
               "decode_avg_ms": None, "device": None, "message": "", "exit": errors.EXIT_USAGE}
        print(f"[migrator] baseline {i}/{len(args.recipes)}: {raw}", file=sys.stderr, flush=True)
        rows.append(row)
        found = Recipe.at(recipe)
        if found.refusal:                      # the same line classify and run give
            row["message"] = found.refusal
            continue
        if not found.is_recipe:
            row["message"] = (f"{raw}: a checkpoint, not a recipe; `migrator run {raw}` migrates it"
                              if found.kind == "checkpoint" else f"{raw}: not a recipe ({found.reason})")
            continue
        try:
            state, options = inputs.validate_recipe(found, args, args.max_rounds)
            summary = run_migration(state, options=options)
            row.update(status=summary.get("status"), message=summary.get("message", ""),
                       exit=errors.EXIT_OK if summary.get("status") == "ok" else errors.EXIT_FAILED)
            if summary.get("baseline_path"):
                data = load_json(Path(summary["baseline_path"]))
                row.update(model=data["model_config"]["model_name"], device=data["environment"].get("device"),
                           prefill_ms=data["performance"]["prefill_ms"],
                           decode_avg_ms=data["performance"]["decode_avg_ms"])
        except MigratorError as exc:       # refused before it ran: bad input, no NPU, unwritable, busy
            status = {errors.EXIT_BUSY: "busy", errors.EXIT_USAGE: "refused"}.get(exc.exit_code, "error")
            if isinstance(exc, errors.EnvironmentProblem):
                status = "needs_npu" if "needs an Ascend NPU" in str(exc) else "error"
            row.update(status=status, message=str(exc), exit=exc.exit_code)
        except LoadError as exc:           # a YAML / JSON file of the recipe, refused by engine.safe_load
            row.update(status="refused", message=str(exc), exit=errors.EXIT_USAGE)
    summary_path = Path(args.summary)
    summary_path.parent.mkdir(parents=True, exist_ok=True)     # where the user asked for it
    with parent_tree(summary_path).open(summary_path.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(SUMMARY_COLUMNS[:5]) + " |", "|" + " --- |" * 5]
    for row in rows:
        lines.append("| " + " | ".join("" if row[c] is None else str(row[c]) for c in SUMMARY_COLUMNS[:5]) + " |")
    parent_tree(summary_path).write_text(summary_path.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"summary: {summary_path.with_suffix('.md')} and {summary_path.with_suffix('.csv')}")
    problems = [r for r in rows if r["exit"] != errors.EXIT_OK]
    if not problems:
        return errors.EXIT_OK
    if any(r["exit"] == errors.EXIT_FAILED for r in problems):
        return errors.EXIT_FAILED          # a recipe ran and fails: the table says which
    for r in problems:                    # refused before running: one line each, the class as the exit code
        named = r["recipe"] in r["message"] or str(Path(r["recipe"]).expanduser().resolve()) in r["message"]
        message = _advice_for(args, r["message"])
        print(f"migrator: error: {message if named else r['recipe'] + ': ' + message}", file=sys.stderr)
    codes = {r["exit"] for r in problems}
    return codes.pop() if len(codes) == 1 else errors.EXIT_FAILED


def cmd_rollback(args) -> int:
    recipe = Path(args.recipe)
    if not recipe.is_dir():
        raise errors.InputError(f"{args.recipe}: no such recipe directory")
    from agent import folder_lock

    with folder_lock.holding(recipe, "roll it back"):     # never while a run or baseline writes the recipe
        return _rollback(args, recipe)


def _rollback(args, recipe: Path) -> int:
    from agent.recipe.registry import unregister, was_registered
    from agent.recipe.targets import state_dir

    if was_registered(state_dir(recipe)) and args.round is None and not has_backups(recipe):
        # a framework recipe no repair touched: what its migration changed outside it is the registry line
        registry = unregister(state_dir(recipe))
        if registry is not None:
            print(f"removed {recipe.resolve().name} from {registry} (its other bytes kept); "
                  f"the recipe folder {recipe} is left for you to delete")
        else:
            print(f"{recipe}: its registry line is gone already; nothing to roll back")
        return 0
    try:
        round_no, changes = rollback(recipe, args.round, force=args.force)
    except FileNotFoundError as exc:
        raise errors.InputError(str(exc)) from exc
    except OSError as exc:      # e.g. a read-only recipe: what was restored so far is kept
        fault = errors.filesystem_fault(exc, recipe)     # EPERM / EROFS / EACCES / ENOSPC: exit 74
        if fault is not None:
            raise errors.FilesystemFault(f"rollback stopped: {fault}") from exc
        raise errors.InputError(f"{args.recipe}: rollback stopped: {exc}") from exc
    for change in changes:
        print(change)
    print(f"rolled back {recipe} to before repair round {round_no} ({len(changes)} file(s) changed)")
    if was_registered(state_dir(recipe)):
        # what the migration changed outside the recipe goes too, after repair rounds as without them
        registry = unregister(state_dir(recipe))
        if registry is not None:
            print(f"removed {recipe.resolve().name} from {registry} (its other bytes kept); "
                  f"the recipe folder {recipe} is left for you to delete")
    return 0


def main(argv: list[str] | None = None) -> int:
    from agent.secrets import hold_secrets

    hold_secrets()      # the LLM API key stays in this process: no child sees it, no file holds it
    entry = argv is None       # the process's own command (console script, python -m): not a caller's main(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    as_json = "--json" in argv     # before parsing: a usage error answers in JSON too
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:   # --help, or a usage error already printed in one line
        code = exc.code if isinstance(exc.code, int) else errors.EXIT_USAGE
        if code and as_json and _USAGE_ERRORS:
            _print_json_error(code, _USAGE_ERRORS[-1])
        return code
    as_json = bool(getattr(args, "json", False))
    args.typed = argv          # what the user typed: advice that repeats the command repeats it
    install_signal_handlers()     # SIGTERM like Ctrl-C: the running tree is stopped, one line (run: --resume works)
    # only `run` has --resume: the other commands' interrupt line names nothing to continue with
    again = "; continue with --resume" if args.command == "run" else ""
    try:
        code = _command(args, as_json)
        if entry:
            _exit_on_late_signal(code)
        return code
    except KeyboardInterrupt:
        print(f"migrator: interrupted{again}", file=sys.stderr)
        if as_json:
            _print_json_error(errors.EXIT_INTERRUPTED, f"interrupted{again}", "interrupted")
        return _exit_after_signal(errors.EXIT_INTERRUPTED)
    except Terminated:
        print(f"migrator: terminated (SIGTERM){again}", file=sys.stderr)
        if as_json:
            _print_json_error(errors.EXIT_TERMINATED, f"terminated (SIGTERM){again}", "terminated")
        return _exit_after_signal(errors.EXIT_TERMINATED)


def _command(args, as_json: bool) -> int:
    """The command, from its first import of torch (a probe of torch_npu in a child, bounded) on."""
    try:
        import_torch()  # first torch import of the process: guarded against torch_npu without CANN
    except TorchImportError as exc:
        return _fail(f"torch cannot be imported ({exc}); fix the torch installation", errors.EXIT_ENVIRONMENT,
                     as_json)
    try:
        inputs.check_environment(args.command)
        inputs.check_home_references(args)
    except MigratorError as exc:
        return _fail(str(exc), exc.exit_code, as_json)
    handler = {"run": cmd_run, "demo": cmd_demo, "env": cmd_env, "classify": cmd_classify,
               "rollback": cmd_rollback, "baseline": cmd_baseline, "standin": cmd_standin,
               "convert": cmd_convert}[args.command]
    try:
        return handler(args)
    except errors.FilesystemFault as exc:
        return _fail(_advice_for(args, str(exc)), exc.exit_code, as_json)
    except MigratorError as exc:
        return _fail(str(exc), exc.exit_code, as_json)
    except LoadError as exc:      # a YAML / JSON file we were given, refused by engine.safe_load: file and line
        return _fail(str(exc), errors.EXIT_USAGE, as_json)
    except WriteRefused as exc:   # a write engine.safe_write refused (a link out of the folder): the link named
        return _fail(str(exc), errors.EXIT_USAGE, as_json)

    except Exception as exc:  # noqa: BLE001 - a bug: one line here, the traceback in a file
        fault = errors.filesystem_fault(exc, _written_place(args))   # disk full, read-only, removed: not a bug
        if fault is not None:
            return _fail(_advice_for(args, str(fault)), fault.exit_code, as_json)
        from agent.migrate import import_probe

        broken = import_probe.failure(exc)      # an installed package that cannot be imported here: not a bug
        if broken is not None:
            return _fail(import_probe.line(broken, sys.executable), errors.EXIT_ENVIRONMENT, as_json)
        return _internal_error(exc, as_json)


def _advice_for(args, message: str) -> str:
    """A filesystem fault's advice as this command takes it: only `migrator run` has --resume."""
    return message if args.command == "run" else message.replace(errors.RESUME_NOTE, "")


def _written_place(args) -> str | None:
    """Where a command writes (for a filesystem fault whose error names no file): the recipe it
    repairs or measures, else the output dir."""
    target = getattr(args, "target", None)
    if target and (args.command in ("baseline", "rollback") or inputs.is_recipe_folder(target)):
        return str(Path(target).expanduser().resolve())
    output_dir = getattr(args, "output_dir", None)
    return str(Path(output_dir).expanduser().resolve()) if output_dir else None


def _fail(message: str, code: int, as_json: bool) -> int:
    """One line on stderr; with --json, the same as a JSON object on stdout."""
    line = _one_line(message)
    print(f"migrator: error: {line}", file=sys.stderr)
    if as_json:
        _print_json_error(code, line)
    return code


def _print_json_error(code: int, line: str, status: str = "error") -> None:
    print(json.dumps({"status": status, "exit_code": code, "error": line}, indent=2), flush=True)


def _exit_on_late_signal(code: int) -> None:
    """The command has finished and printed its answer: a SIGINT / SIGTERM that lands while the interpreter
    tears down ends the process with that answer's code, not as killed by the signal (-2 / -15, no line:
    found by scripts/signal_matrix.py at the last node). While threads are joined a signal exits at once
    with the code; from the exit handlers on it is ignored (Python restores the default disposition of a
    signal it handles before the rest of its teardown, where the default would kill the process)."""
    import atexit
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def leave(signum, frame):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def ignore():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    signal.signal(signal.SIGINT, leave)
    signal.signal(signal.SIGTERM, leave)
    atexit.register(ignore)         # registered last: the first exit handler to run


def _exit_after_signal(code: int) -> int:
    """The process ends with `code`, nothing after it: the interpreter would otherwise report a
    KeyboardInterrupt that a library let through once as death by SIGINT (-2), and run atexit
    handlers a second Ctrl-C could interrupt. Registered last, this atexit handler runs first."""
    import atexit

    def leave():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    atexit.register(leave)
    return code


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "(no message)"


def _internal_error(exc: Exception, as_json: bool = False) -> int:
    import tempfile
    import traceback

    from agent.processes import OUTER_TMP_ENV

    outer = os.environ.get(OUTER_TMP_ENV)       # in a tree's own temporary folder: the one outside it (kept)
    with tempfile.NamedTemporaryFile("w", prefix="migrator-crash-", suffix=".txt", delete=False,
                                     dir=outer if outer and os.path.isdir(outer) else None) as f:
        traceback.print_exc(file=f)
    line = (f"internal error: {type(exc).__name__}: {_one_line(str(exc))[:300]} (a bug; traceback "
            f"saved to {f.name}, please report it)")
    print(f"migrator: {line}", file=sys.stderr)
    if as_json:
        _print_json_error(errors.EXIT_INTERNAL, line)
    return errors.EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
