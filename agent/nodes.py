"""The workflow's nodes: each takes the state and returns the keys it changes (SPEC §2)."""

from __future__ import annotations

import json
import operator
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any, TypedDict

from agent.errors import EnvironmentProblem, InputError, MigratorError
from engine import defaults


def merge_rounds(rounds: list[dict], new: list[dict]) -> list[dict]:
    """The reducer of `rounds`: diagnose opens a round, repair completes it, so a round whose number
    is already there replaces it; any other is appended."""
    merged = list(rounds)
    for item in new:
        at = next((i for i, old in enumerate(merged) if old.get("round") == item.get("round")), None)
        if at is None:
            merged.append(item)
        else:
            merged[at] = item
    return merged


class MigrationState(TypedDict, total=False):
    # inputs
    target: str                 # what the user gave: link, Org/Name, checkpoint dir or recipe dir
    output_dir: str
    name: str | None
    device: str
    dtype: str | None
    weights: str | None
    trust_remote_code: bool
    allow_install: bool
    max_rounds: int
    timeout_s: int
    max_new_tokens: int
    world_size: int             # --world-size: cards for one tensor-parallel run (default 1)
    # derived
    env: dict
    scenario: str               # "A" migrate, "B" repair, "C" baseline
    classify_reason: str
    recipe_dir: str
    model_name: str
    model_dir: str              # local checkpoint directory
    model_source: str           # link or path recorded in the baseline
    architecture: str
    family: str
    vendored: dict
    rendered: list[str]
    # Nodes return only their new items: LangGraph appends runs and merges rounds.
    runs: Annotated[list[dict], operator.add]     # every trial run, in order
    rounds: Annotated[list[dict], merge_rounds]   # repair rounds: diagnosis, diff
    memory: dict
    baseline: dict              # collected by collect_baseline; verify adds parity and writes it
    baseline_path: str
    verification: dict
    status: str                 # "ok" | "failed" | "oom" | ...
    message: str


def node_detect_env(state: MigrationState) -> dict:
    from engine.environment import DeviceUnavailableError, detect_environment, select_device

    device = state.get("device", "auto")
    try:
        select_device(device)
    except DeviceUnavailableError as exc:
        raise EnvironmentProblem(str(exc)) from exc
    return {"env": detect_environment(device)}


def _is_recipe(path: Path) -> bool:
    from agent.foreign import describe

    return describe(path).is_recipe


def ensure_runnable_here(info) -> None:
    """Exit 4 before any run or edit when the recipe calls NPU kernels and this host has no NPU."""
    from agent.npu_scan import npu_usable, scan_recipe

    scan = scan_recipe(info.path, info.repo_root, info.entry_files)
    if scan.needs_npu and not npu_usable():
        raise EnvironmentProblem(scan.message())


def node_classify(state: MigrationState) -> dict:
    """Checkpoint (config.json + weights) or no recipe -> A; a recipe that runs -> C; one that fails -> B.

    A recipe is a folder with its own infer.sh, or a model folder that its repository's shared
    entry point runs (executor/scripts/infer.sh --model NAME --yaml FILE); see agent.foreign.
    """
    from agent.foreign import describe

    info = describe(state["target"]) if Path(state["target"]).expanduser().exists() else None
    if info is None or not info.is_recipe:
        reason = "no infer.sh: migrate the model into a new recipe"
        if info is not None and info.kind == "checkpoint" and (info.path / "infer.sh").exists():
            reason = ("a checkpoint (config.json and weights): its infer.sh is not run; "
                      "migrate the model into a new recipe")
        return {"scenario": "A", "classify_reason": reason}
    ensure_runnable_here(info)
    target = info.path
    how = info.reason
    run = trial_run(target, state, label="classify")
    if run["ok"]:
        return {"scenario": "C", "classify_reason": f"{how} and it runs",
                "recipe_dir": str(target), "runs": [run]}
    return {"scenario": "B", "classify_reason": f"{how} but it fails: {run['summary']}",
            "recipe_dir": str(target), "runs": [run]}


def node_acquire(state: MigrationState) -> dict:
    from agent.acquire import acquire
    from agent.checkpoint_check import check_checkpoint, check_output_outside
    from agent.render import normalise_model_name

    got = acquire(state["target"], weights=state.get("weights"))
    check_checkpoint(Path(got.model_dir), bool(state.get("trust_remote_code")))    # before anything is written: bad input is exit 2
    name = normalise_model_name(state["name"], explicit=True) if state.get("name") \
        else normalise_model_name(got.name_hint)
    output_dir = Path(state.get("output_dir") or "models").resolve()
    check_output_outside(Path(got.model_dir), output_dir, str(state.get("output_dir")))
    recipe_dir = output_dir / name
    if recipe_dir.exists() and any(recipe_dir.iterdir()):
        raise InputError(f"{recipe_dir} already exists; run `migrator run {recipe_dir}` to repair or "
                         "re-baseline it, or choose another --name / --output-dir")
    return {"model_dir": str(got.model_dir), "model_source": got.source, "model_name": name,
            "recipe_dir": str(recipe_dir)}


def _removes_half_built_recipe(node):
    """A failed vendor/render leaves no half-built recipe behind to block the next run (the
    recipe directory did not exist or was empty before: node_acquire checked)."""
    import functools
    import shutil

    @functools.wraps(node)
    def wrapper(state: MigrationState) -> dict:
        try:
            return node(state)
        except BaseException:
            shutil.rmtree(state["recipe_dir"], ignore_errors=True)
            raise
    return wrapper


@_removes_half_built_recipe
def node_vendor(state: MigrationState) -> dict:
    from agent.routing import route
    from agent.vendor import locate_source, read_config, vendor_source

    model_dir = Path(state["model_dir"])
    config = read_config(model_dir)
    source = locate_source(config, model_dir, trust_remote_code=bool(state.get("trust_remote_code")))
    family = route(config.get("text_config") or config)
    recipe_dir = Path(state["recipe_dir"])
    result = vendor_source(source, recipe_dir, state["model_name"])
    return {
        "architecture": source.architecture,
        "family": family.name,
        "vendored": {
            "model_class": source.model_class,
            "config_class": source.config_class,
            "modeling_module": source.modeling_module,
            "configuration_module": source.configuration_module,
            "origin": source.origin,
            "attn_implementation": source.attn_implementation,
            "files": {role: str(path.relative_to(recipe_dir)) for role, path in result.files.items()},
            "codemods": result.codemods,
        },
    }


@_removes_half_built_recipe
def node_render(state: MigrationState) -> dict:
    from agent.render import render_recipe
    from agent.spec import RecipeSpec
    from agent.vendor import read_config

    recipe_dir = Path(state["recipe_dir"])
    spec = RecipeSpec.for_checkpoint(
        model_name=state["model_name"], model_dir=Path(state["model_dir"]), model_source=state["model_source"],
        architecture=state["architecture"], family=state["family"], vendored=state["vendored"],
        config=read_config(Path(state["model_dir"])), device=state.get("device", "auto"), dtype=state.get("dtype"),
        max_new_tokens=state.get("max_new_tokens"), world_size=state.get("world_size"))
    written = render_recipe(recipe_dir, spec.context(), spec.family_spec())
    return {"rendered": [str(p.relative_to(recipe_dir)) for p in written]}


NO_WARM_UP = "BaselineError: infer.py ran without a warm-up generation"


def find_logs(run_dir: Path, cwd: Path, since: float) -> Path | None:
    """The folder with the run's log_{rank}.log: RES_PATH (run_dir) when the recipe honours it,
    else the newest res/<date>/<case>/ the upstream launch wrote under its working directory."""
    if any(run_dir.glob("log_*.log")):
        return run_dir
    found = [p for base in dict.fromkeys((run_dir, cwd)) for p in base.glob("res/*/*/log_0.log")
             if p.stat().st_mtime >= since - 1]
    return max(found, key=lambda p: p.stat().st_mtime).parent if found else None


def _static_warm_up(recipe_dir: Path) -> bool:
    """infer.py asks for a warm-up generation (some runners log nothing while warming up)."""
    import re

    infer_py = recipe_dir / "infer.py"
    if not infer_py.is_file():
        return False
    return bool(re.search(r"warm_up\s*=\s*True", infer_py.read_text(errors="replace")))


def judge_run(output: str, log_dir: Path | None, recipe_dir: Path, framework: bool) -> dict:
    """The verdict from evidence, whatever infer.sh returned (upstream's launch ends with `wait`).

    A traceback in the output or a rank log, a missing formal prefill line, or a rank that did not
    finish its formal run makes the run failed. Returns {"problem", "extra", "no_warm_up", "prefills"}:
    `extra` is rank-log text (tracebacks) missing from the output, kept as evidence.
    """
    from agent import run_log

    traceback_re = run_log.TRACEBACK_RE
    problem = None
    extra: list[str] = []
    if traceback_re.search(output):
        problem = "traceback in the output"
    logs = sorted(log_dir.glob("log_*.log")) if log_dir is not None else []
    rank_logs = [p for p in logs if run_log.RANK_LOG_RE.match(p.name)]
    rank0 = None
    for path in rank_logs:
        text = path.read_text(errors="replace")
        if traceback_re.search(text):
            problem = problem or f"traceback in {path.name}"
            block = text[traceback_re.search(text).start():]
            if block.strip()[:2000] not in output:
                extra.append(f"==> {path.name} <==\n{block}")
        parsed = run_log.parse_log_text(text, path)
        selection = run_log.select_formal(parsed)
        if path.name == "log_0.log":
            rank0 = (parsed, selection)
        elif not selection.success and problem is None:
            problem = f"rank {path.stem.removeprefix('log_')} did not finish its formal run"
    if rank0 is None:
        # no rank-0 log: the output itself may carry the timing lines (a recipe logging to stdout)
        parsed = run_log.parse_log_text(output, "output.txt")
        rank0 = (parsed, run_log.select_formal(parsed))
    parsed, selection = rank0
    prefills = sum(len(r.segments) for r in parsed.runs)
    if problem is None and selection.segment is None:
        problem = "no formal prefill line in log_0.log" if logs else "no log_0.log and no formal prefill line"
    elif problem is None and not selection.success:
        problem = "the formal run did not finish (no 'Request N: outputs:' line)"
    run = selection.run or parsed.runs[-1]
    no_warm_up = (problem is None and not framework and not run.warmed_up()
                  and not _static_warm_up(recipe_dir))
    return {"problem": problem, "extra": extra, "no_warm_up": no_warm_up, "prefills": prefills}


def trial_run(recipe_dir: Path, state: MigrationState, label: str) -> dict:
    """Run the recipe (its infer.sh, or the repository's entry point for a framework recipe) in a
    subprocess with a timeout; output and logs kept under .migrator/runs/. Paths are absolute,
    so the run never depends on the caller's working directory."""
    from agent.foreign import describe
    from agent.failure import summarise_failure

    recipe_dir = Path(recipe_dir).expanduser().resolve()
    info = describe(recipe_dir)
    runs_dir = recipe_dir / ".migrator" / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    index = len(list(runs_dir.glob("run_*")))
    run_dir = runs_dir / f"run_{index}_{label}"
    run_dir.mkdir()
    env = dict(os.environ, RES_PATH=str(run_dir), PYTHON=sys.executable, PYTHONUNBUFFERED="1",
               # the formal run leaves its prompt logits for the parity check (engine.model_runner)
               MIGRATOR_PARITY_DUMP=str(run_dir / "parity_dump.pt"))
    if info.kind == "framework":
        command, cwd = info.command(), run_dir        # upstream writes res/<date>/<case>/ under cwd
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(info.repo_root), env.get("PYTHONPATH")]))
    else:
        command, cwd = ["bash", str(recipe_dir / "infer.sh")], recipe_dir
    if (state.get("world_size") or 1) > 1:  # --world-size N: the N-card YAML (written if the recipe lacks it)
        env["YAML_FILE"] = str(_recipe_yaml(recipe_dir, state["world_size"]).relative_to(recipe_dir))
    timeout = state.get("timeout_s") or defaults.TIMEOUT_S
    from agent.processes import run_tree, stop_leftovers

    stop_leftovers(runs_dir / "running.pids")       # a tree a killed migrator left behind
    start = time.perf_counter()
    started_at = time.time()
    with open(run_dir / "output.txt", "w") as out:
        # No stdin: a prompt (e.g. "run custom code? [y/N]") must fail, not wait forever. The whole
        # tree (torchrun ranks, `&` launches) is stopped on a timeout or a signal, and measured.
        tree = run_tree(command, cwd=cwd, env=env, stdout=out, timeout=timeout, pids_file=runs_dir / "running.pids")
        returncode, timed_out = tree.returncode, tree.timed_out
    output = (run_dir / "output.txt").read_text(errors="replace")
    log_dir = find_logs(run_dir, Path(cwd), started_at)
    verdict = judge_run(output, log_dir, recipe_dir, info.kind == "framework")
    ok = returncode == 0 and not timed_out and verdict["problem"] is None and not verdict["no_warm_up"]
    evidence = output
    if verdict["extra"]:
        evidence = output.rstrip("\n") + "\n" + "\n".join(verdict["extra"])
    if verdict["no_warm_up"] and returncode == 0 and not timed_out:
        # A conclusion, not an error: recorded only when the run shows no real error.
        evidence = evidence.rstrip("\n") + (f"\n{NO_WARM_UP} ({verdict['prefills']} prefill in log_0.log)\n")
    output_file = run_dir / "output.txt"
    if evidence != output:
        output_file = run_dir / "evidence.txt"
        output_file.write_text(evidence)
    if ok:
        summary = "ok"
    elif timed_out:
        summary = "timed out after %ds" % timeout
    else:
        failure = summarise_failure(evidence, roots=[recipe_dir, info.repo_root])
        summary = failure["error"]
        if failure.get("location"):
            summary += f" (at {failure['location']})"
        elif returncode not in (0, None) and not failure.get("traceback"):
            summary = f"exit code {returncode}: {summary}"
        elif verdict["problem"] and not failure.get("traceback") and not verdict["no_warm_up"]:
            summary = f"{verdict['problem']}: {summary}" if summary != "no output" else verdict["problem"]
        summary = summary[-300:]
    return {"label": label, "ok": ok, "returncode": returncode, "timed_out": timed_out,
            "seconds": round(time.perf_counter() - start, 2), "peak_rss_bytes": tree.peak_rss_bytes,
            "processes": tree.processes, "res_path": str(run_dir),
            "log_dir": str(log_dir) if log_dir is not None else None, "problem": verdict["problem"],
            "output_file": str(output_file), "summary": summary}


def node_trial_run(state: MigrationState) -> dict:
    recipe_dir = Path(state["recipe_dir"])
    run = trial_run(recipe_dir, state, label=f"trial{len(state.get('rounds') or [])}")
    return {"runs": [run]}


def last_run(state: MigrationState) -> dict:
    return (state.get("runs") or [{}])[-1]


def node_diagnose(state: MigrationState) -> dict:
    from agent.repair import diagnose

    diagnosis = diagnose(Path(state["recipe_dir"]), last_run(state))
    return {"rounds": [{"round": len(state.get("rounds") or []) + 1, "diagnosis": diagnosis}]}


def node_repair(state: MigrationState) -> dict:
    from agent.repair import repair
    from agent.repair_rules.rule import RepairContext

    context = RepairContext(allow_install=bool(state.get("allow_install")), timeout_s=state.get("timeout_s") or defaults.TIMEOUT_S,
                            trust_remote_code=bool(state.get("trust_remote_code")))
    last = state["rounds"][-1]
    # The fix sees the failure diagnose saw: rebuilt from the same run record.
    return {"rounds": [dict(last, **repair(Path(state["recipe_dir"]), last["diagnosis"], round_no=last["round"],
                                          context=context, run=last_run(state)))]}


def node_estimate_memory(state: MigrationState) -> dict:
    """After an out-of-memory run: the estimate per rank for tp = 1, 2, 4, ... 16 against one card;
    the single-card recipe is kept and the smallest N that fits is written as an N-card YAML."""
    from agent.memory import estimate_for_recipe, write_multicard_yaml

    recipe_dir = Path(state["recipe_dir"])
    memory = estimate_for_recipe(recipe_dir, state.get("env") or {})
    have = f"{memory['device_bytes'] / 2**30:.2f} GiB per {memory['device']} device" if memory["device_bytes"] \
        else "unknown device memory"
    message = (f"out of memory: needs about {memory['needed_gib']:.2f} GiB on one card (weights "
               f"{memory['weights_bytes'] / 2**30:.2f} GiB + KV cache {memory['kv_cache_bytes'] / 2**30:.2f} GiB "
               f"+ runtime) with {have}")
    cards = memory["cards_needed"]
    if cards and cards > 1:
        yaml_file = write_multicard_yaml(recipe_dir, cards)
        rank = memory["per_rank"][cards]
        command = f"cd {recipe_dir} && YAML_FILE=config/{yaml_file.name} bash infer.sh"
        memory.update(multicard_yaml=str(yaml_file.relative_to(recipe_dir)), multicard_command=command)
        message += (f"; {cards} cards fit (tensor parallel, {rank['needed_bytes'] / 2**30:.2f} GiB per rank): "
                    f"world_size: {cards} written to config/{yaml_file.name}, run it with `{command}` or "
                    f"`migrator run {recipe_dir} --world-size {cards}` (the single-card recipe is kept)")
        readme = recipe_dir / "README.md"
        if readme.is_file() and "## On more cards" not in readme.read_text():
            with open(readme, "a") as f:
                f.write(f"\n## On more cards\n\nThe model does not fit one card ({have}); on {cards} cards, "
                        f"tensor parallel (about {rank['needed_bytes'] / 2**30:.2f} GiB per rank):\n\n"
                        f"```bash\nYAML_FILE=config/{yaml_file.name} bash infer.sh\n```\n")
    elif memory["tp_sharded_bytes"] is None:
        message += f"; {memory.get('model_type')} has no tensor-parallel plan, so more cards do not help"
    elif cards is None and memory["device_bytes"]:
        message += f"; even {max(memory['per_rank'])} cards do not fit (lower batch_size / input_max_len, or a smaller dtype)"
    return {"memory": memory, "status": "oom", "message": message}


def node_collect_baseline(state: MigrationState) -> dict:
    """The baseline of the last run, kept in the state: verify adds parity and writes the file."""
    from agent import baseline
    from agent.foreign import describe

    recipe_dir = Path(state["recipe_dir"])
    info = describe(recipe_dir)
    run = last_run(state)
    yaml_file = info.yaml or _recipe_yaml(recipe_dir, state.get("world_size") or 1)
    try:
        collected, _warnings = baseline.collect(run.get("log_dir") or run["res_path"], str(yaml_file),
                                                model_source=state.get("model_source"))
    except Exception as exc:  # reported like the collector script reports it, one line
        raise MigratorError(f"baseline collection failed: {baseline.error_line(exc)}") from None
    return {"baseline_path": str(info.baseline_dir() / "baseline_metadata.json"), "baseline": collected}


def _recipe_yaml(recipe_dir: Path, world_size: int = 1) -> Path:
    from agent.memory import recipe_yaml, write_multicard_yaml

    yamls = sorted((recipe_dir / "config").glob("*.yaml"))
    if not yamls:
        raise InputError(f"{recipe_dir}/config has no YAML file")
    found = recipe_yaml(recipe_dir, world_size)
    if world_size > 1 and not found.name.endswith(f"_{world_size}card_eager.yaml"):
        found = write_multicard_yaml(recipe_dir, world_size)
    return found


def node_verify(state: MigrationState) -> dict:
    """Parity against the original implementation when it is importable; the baseline collected
    before, with this verification, is written to baseline_path (its one write)."""
    from agent.baseline import with_verification, write_baseline
    from agent.parity import run_parity

    recipe_dir = Path(state["recipe_dir"])
    baseline_path = Path(state["baseline_path"])
    # a run resumed from a release whose collect node wrote the file has no baseline in its state
    collected = state.get("baseline") or json.loads(baseline_path.read_text())
    if _engine_recipe(recipe_dir):
        dump = Path(last_run(state).get("res_path") or recipe_dir) / "parity_dump.pt"
        parity = run_parity(recipe_dir, trust_remote_code=bool(state.get("trust_remote_code")),
                            dump=dump if dump.is_file() else None)
    else:
        parity = _foreign_parity(recipe_dir)
    baseline = with_verification(collected, parity)
    write_baseline(baseline_path, baseline)
    problems = []
    if not baseline["verification"].get("all_ranks_success", False):
        problems.append("not every rank finished its formal run")
    output_check = baseline["verification"].get("output_check") or {}
    if output_check.get("ok") is False:
        problems.append(f"abnormal output text: {'; '.join(output_check.get('reasons') or [])}")
    if parity.get("ok") is False:
        problems.append(f"parity check failed: {parity.get('reason') or _parity_numbers(parity)}")
    update = {"verification": baseline["verification"], "status": "failed" if problems else "ok"}
    if problems:
        update["message"] = "; ".join(problems)
    if output_check.get("ok") is False:
        # Abnormal text from trained weights goes back to diagnosis like a failed run.
        run = dict(last_run(state), label="verify", ok=False, summary="abnormal output")
        note = Path(run["res_path"]) / "output_check.txt"
        note.write_text(Path(run["output_file"]).read_text(errors="replace") +
                        f"\nOutputCheckError: {'; '.join(output_check.get('reasons') or [])}\n")
        run["output_file"] = str(note)
        update["runs"] = [run]
    return update


def _engine_recipe(recipe_dir: Path) -> bool:
    """A recipe on this tool's engine (its Runner subclasses engine.model_runner.ModelRunner)."""
    return any("engine.model_runner" in p.read_text(errors="replace") for p in recipe_dir.glob("runner_*.py"))


_NLL_SNIPPET = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from agent.parity import prompt_nll
from engine.data import DEFAULT_PROMPT
path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
ids = tok([DEFAULT_PROMPT], return_tensors="pt")
with torch.inference_mode():
    logits = model(**ids).logits
print(json.dumps(prompt_nll(logits, ids["input_ids"])))
"""


def _foreign_parity(recipe_dir: Path) -> dict:
    """A recipe written for another runtime (cann-recipes-infer's executor): its model code is not
    ours to compare against transformers, so parity is not applicable; whether the checkpoint's
    weights are trained (random weights write noise by design) is still judged from the checkpoint."""
    from agent.foreign import describe

    result = {"ok": None, "checked": False,
              "reason": "not a recipe on this tool's engine (e.g. a cann-recipes-infer recipe): parity not applicable"}
    info = describe(recipe_dir)
    try:
        import yaml

        cfg = yaml.safe_load(info.yaml.read_text()) if info.yaml else {}
        model_config = cfg.get("model_config") if isinstance(cfg.get("model_config"), dict) else {}
        model_path = model_config.get("model_path") or cfg.get("model_path")
        model_path = Path(model_path) if model_path else None
        if model_path is not None and not model_path.is_absolute():
            model_path = (recipe_dir / model_path).resolve()
        if model_path is None or not (model_path / "config.json").is_file():
            return result
        import tempfile

        from agent.processes import run_tree

        with tempfile.TemporaryFile("w+") as out:
            tree = run_tree([sys.executable, "-c", _NLL_SNIPPET, str(model_path)], cwd=recipe_dir, env=dict(os.environ),
                            stdout=out, stderr=subprocess.DEVNULL, timeout=600)
            out.seek(0)
            text = out.read().strip()
        if tree.returncode == 0 and text:
            result.update(json.loads(text.splitlines()[-1]))
    except Exception:   # the judgement is optional: never fail a baseline over it
        pass
    return result


def _parity_numbers(parity: dict) -> str:
    return (f"max |logits diff| {parity.get('max_abs_logits_diff')} (tolerance {parity.get('tolerance')}), "
            f"greedy tokens equal: {parity.get('greedy_tokens_equal')}")


def node_report(state: MigrationState) -> dict:
    from agent.report import write_report

    write_report(state)
    return {}


def summarise(state: dict[str, Any]) -> dict:
    keys = ("scenario", "status", "message", "recipe_dir", "model_name", "architecture", "family",
            "baseline_path")
    return {k: state.get(k) for k in keys if state.get(k) is not None}


def node_give_up(state: MigrationState) -> dict:
    last = state["rounds"][-1]
    diagnosis = last["diagnosis"]
    where = f" at {diagnosis['location']}" if diagnosis.get("location") else ""
    # A rule that only reports (e.g. the pip install line) says what to do in its note.
    note = f"; {last['note']}" if last.get("note") and last.get("note") != "no repair rule matched" else ""
    return {"status": "failed", "message": f"{diagnosis['diagnosis']}{where}{note}"}
