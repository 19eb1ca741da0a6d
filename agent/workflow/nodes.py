"""The workflow's nodes: each takes the state and returns the keys it changes (SPEC §2). The work
is done by the modules of the scenario it belongs to; a node only reads the state and calls them."""

from __future__ import annotations

import functools
import json
import shutil
import sys
from pathlib import Path

from agent.errors import EnvironmentProblem, InputError, MigratorError
from agent.measure import baseline, memory, verify
from agent.migrate.acquire import acquire
from agent.migrate import transformers_source
from agent.migrate.checkpoint_check import check_checkpoint, check_output_outside
from agent.migrate.vendor import locate_source, read_config, vendor_source
from agent.recipe import folder_lock
from agent.recipe.chat_template import check_chat_template
from agent.recipe.runnable import ensure_runnable_here
from agent.recipe.recipe import Recipe, RunPlan
from agent.recipe.registry import register, registered_names
from agent.recipe.render import normalise_model_name, render_recipe, template_context
from agent.recipe.targets import REGISTRY, TARGETS, checkout_root, choose_target, framework_registry_entry, state_dir
from agent.recipe.routing import route
from agent.recipe.spec import RecipeSpec
from agent.recipe.trial_run import trial_run
from agent.repair.diagnose import diagnose
from agent.repair.fix import repair
from agent.repair.rules.rule import RepairContext
from agent.workflow.report import write_report
from agent.workflow.state import MigrationState, last_run
from engine import defaults
from engine.environment import DeviceUnavailableError, detect_environment, select_device
from engine.safe_load import load_json


def node_detect_env(state: MigrationState) -> dict:
    device = state.get("device", "auto")
    try:
        select_device(device)
    except DeviceUnavailableError as exc:
        raise EnvironmentProblem(str(exc)) from exc
    return {"env": detect_environment(device)}


def node_classify(state: MigrationState) -> dict:
    """A checkpoint, or no recipe -> A; a recipe (agent.recipe.recipe) that runs -> C; one that fails -> B.
    Nothing inside a checkpoint is run, even an infer.sh."""
    recipe = Recipe.at(state["target"]) if Path(state["target"]).expanduser().exists() else None
    if recipe is None or not recipe.is_recipe:
        reason = "no infer.sh: migrate the model into a new recipe"
        if recipe is not None and recipe.kind == "checkpoint" and (recipe.path / "infer.sh").exists():
            reason = ("a checkpoint (config.json and weights): its infer.sh is not run; "
                      "migrate the model into a new recipe")
        return {"scenario": "A", "classify_reason": reason}
    standin = state.get("upstream_standin")
    if not standin:
        ensure_runnable_here(recipe)
    plan = plan_run(recipe, state)          # before anything runs: a --world-size it cannot run is refused here
    run = _needs_npu(trial_run(recipe, "classify", plan, state.get("timeout_s"), standin,
                               python=recipe_python(state, recipe.path)))
    how = f"{recipe.reason} and it runs" if run["ok"] else f"{recipe.reason} but it fails: {run['summary']}"
    return {"scenario": "C" if run["ok"] else "B", "classify_reason": how, "recipe_dir": str(recipe.path),
            "run_plan": plan, "runs": [run]}


def plan_run(recipe: Recipe, state: MigrationState) -> dict:
    """The run plan (agent.recipe.recipe.RunPlan: the YAML and its ranks) every trial run of this
    migration uses, decided once: the stand-in plan's YAML copy under --standin, else the recipe's
    YAML for --world-size (None: its own)."""
    standin = state.get("upstream_standin")
    if standin:
        return RunPlan(Path(standin["yaml"]), int(standin.get("world_size") or 1)).as_dict()
    return recipe.run_plan(state.get("world_size")).as_dict()


def node_acquire(state: MigrationState) -> dict:
    got = acquire(state["target"], weights=state.get("weights"))
    check_checkpoint(Path(got.model_dir), bool(state.get("trust_remote_code")))    # before anything is written: bad input is exit 2
    name = normalise_model_name(state["name"], explicit=True) if state.get("name") \
        else normalise_model_name(got.name_hint)
    output_dir = Path(state.get("output_dir") or "models").resolve()
    check_output_outside(Path(got.model_dir), output_dir, str(state.get("output_dir")))
    recipe_dir = output_dir / name
    folder_lock.hold(recipe_dir, "run it")    # another migration into this folder, of any source: refused (exit 75)
    if recipe_dir.exists() and any(recipe_dir.iterdir()):
        raise InputError(f"{recipe_dir} already exists; run `migrator run {recipe_dir}` to repair or "
                         "re-baseline it, or choose another --name / --output-dir")
    recipe_target = choose_target(state.get("recipe_target"), output_dir)
    if TARGETS[recipe_target].registers:
        registry = checkout_root(output_dir) / REGISTRY
        if name in registered_names(registry):
            raise InputError(f"{registry} registers {name!r} already; choose another --name")
    plan = transformers_plan(state, output_dir, recipe_target)
    check_chat_template(Path(got.model_dir), TARGETS[recipe_target])   # a base model upstream's scheduler cannot take
    if plan["origin"]:
        print(f"[migrator] vendoring from {plan['origin']} (the checkout's; {transformers_source.installed_version()} "
              f"is installed); trial runs and parity with {plan['python']}", file=sys.stderr)
    return {"model_dir": str(got.model_dir), "model_source": got.source, "model_name": name,
            "recipe_dir": str(recipe_dir), "recipe_target": recipe_target, "transformers": plan}


def transformers_plan(state: MigrationState, output_dir: Path, recipe_target: str) -> dict:
    """The transformers the recipe is vendored from and runs with (agent.migrate.transformers_source):
    a checkout's pin, its source and the interpreter that has it; settled before anything is written."""
    target = TARGETS[recipe_target]
    transformers_source.check_source_fits(state.get("transformers_source"), target.inside_checkout)
    checkout = checkout_root(output_dir) if target.inside_checkout else None
    plan = transformers_source.plan_for(checkout, state.get("transformers_source"), state.get("reference_python"))
    return {"version": plan.version, "source_root": str(plan.tree.root) if plan.tree else None,
            "origin": plan.tree.origin if plan.tree else None, "python": plan.python}


def removes_half_built_recipe(node):
    """A failed vendor/render leaves no half-built recipe behind to block the next run (the
    recipe directory did not exist or was empty before: node_acquire checked)."""
    @functools.wraps(node)
    def wrapper(state: MigrationState) -> dict:
        try:
            return node(state)
        except BaseException:
            shutil.rmtree(state["recipe_dir"], ignore_errors=True)
            raise
    return wrapper


@removes_half_built_recipe
def node_vendor(state: MigrationState) -> dict:
    model_dir, recipe_dir = Path(state["model_dir"]), Path(state["recipe_dir"])
    config = read_config(model_dir)
    source = locate_source(config, model_dir, trust_remote_code=bool(state.get("trust_remote_code")))
    target = TARGETS[state.get("recipe_target") or "standalone"]
    plan = state.get("transformers") or {}
    tree = transformers_source.SourceTree(plan["version"], Path(plan["source_root"]), plan["origin"]) \
        if plan.get("source_root") else None
    result = vendor_source(source, recipe_dir, state["model_name"],
                           target.vendored_package.format(name=state["model_name"]), tree=tree,
                           model_source=state.get("model_source"), model_dir=model_dir)
    vendored = result.vendored(recipe_dir)
    if plan.get("version"):
        vendored["transformers_version"] = plan["version"]
    return {"architecture": source.architecture, "family": route(config.get("text_config") or config).name,
            "vendored": vendored}


@removes_half_built_recipe
def node_render(state: MigrationState) -> dict:
    recipe_dir, model_dir = Path(state["recipe_dir"]), Path(state["model_dir"])
    spec = RecipeSpec.for_checkpoint(
        model_name=state["model_name"], model_dir=model_dir, model_source=state["model_source"],
        architecture=state["architecture"], family=state["family"], vendored=state["vendored"],
        config=read_config(model_dir), device=state.get("device", "auto"), dtype=state.get("dtype"),
        max_new_tokens=state.get("max_new_tokens"), world_size=state.get("world_size"))
    target = TARGETS[state.get("recipe_target") or "standalone"]
    written = render_recipe(recipe_dir, spec.context(), spec.family_spec(), target)
    rendered = [str(p.relative_to(recipe_dir)) for p in written]
    if target.registers:
        # the one change outside the recipe: its line in the checkout's registry (backed up, undone by rollback)
        ctx = template_context(spec.context(), spec.family_spec(), target)
        edit = register(checkout_root(recipe_dir), spec.model_name, framework_registry_entry(ctx), state_dir(recipe_dir))
        print(f"[migrator] registered {spec.model_name} in {edit.registry} (before: {edit.backup})", file=sys.stderr)
    return {"rendered": rendered, "run_plan": plan_run(Recipe.at(recipe_dir), state)}


def node_trial_run(state: MigrationState) -> dict:
    recipe = Recipe.at(state["recipe_dir"])
    # the plan classify or render decided (a store of an earlier release has none: decided now, once)
    plan = state.get("run_plan") or plan_run(recipe, state)
    run = trial_run(recipe, f"trial{len(state.get('rounds') or [])}", plan, state.get("timeout_s"),
                    state.get("upstream_standin"), python=recipe_python(state))
    return {"runs": [_needs_npu(run)], "run_plan": plan}


def recipe_python(state: MigrationState, recipe_dir: str | Path | None = None) -> str | None:
    """The interpreter the recipe runs with when it is not this one (another transformers): this run's
    --reference-python, else the one its migration ran it with (its report), while it exists."""
    python = (state.get("transformers") or {}).get("python") or state.get("reference_python")
    recipe_dir = recipe_dir or state.get("recipe_dir")
    if python or not recipe_dir or not Path(recipe_dir).is_dir():
        return python
    stored = (Recipe.at(recipe_dir).report().get("transformers") or {}).get("python")
    return stored if stored and Path(stored).is_file() else None


def _needs_npu(run):
    """A stand-in run that called an op without a reference kernel: only an NPU can run it (exit 4)."""
    if run.get("standin_unsupported"):
        raise EnvironmentProblem(f"needs an Ascend NPU: {run['standin_unsupported']}")
    return run


def node_diagnose(state: MigrationState) -> dict:
    diagnosis = diagnose(Path(state["recipe_dir"]), last_run(state))
    return {"rounds": [{"round": len(state.get("rounds") or []) + 1, "diagnosis": diagnosis}]}


def node_repair(state: MigrationState) -> dict:
    context = RepairContext(allow_install=bool(state.get("allow_install")),
                            timeout_s=state.get("timeout_s") or defaults.TIMEOUT_S,
                            trust_remote_code=bool(state.get("trust_remote_code")))
    last = state["rounds"][-1]
    # The fix sees the failure diagnose saw: rebuilt from the same run record.
    done = repair(Path(state["recipe_dir"]), last["diagnosis"], round_no=last["round"], context=context,
                  run=last_run(state))
    return {"rounds": [{**last, **done}]}


def node_estimate_memory(state: MigrationState) -> dict:
    """After an out-of-memory run: the estimate per rank for tp = 1, 2, 4, ... 16 against one card;
    the single-card recipe is kept and the smallest N that fits is written as an N-card YAML."""
    recipe = Recipe.at(state["recipe_dir"])
    estimate = memory.estimate_for_recipe(recipe, state.get("env") or {})
    return {"memory": estimate, "status": "oom", "message": memory.out_of_memory(recipe, estimate)}


def node_collect_baseline(state: MigrationState) -> dict:
    """The baseline of the last run, kept in the state: verify adds parity and writes the file."""
    recipe, run = Recipe.at(state["recipe_dir"]), last_run(state)
    # the YAML of the run that made these logs (its run plan), never one chosen again here
    yaml_file = run.get("yaml") or (state.get("run_plan") or {}).get("yaml")
    if yaml_file is None:
        raise InputError(f"{recipe.path}: the run names no YAML (config/ has none)")
    try:
        collected, _warnings = baseline.collect(run.get("log_dir") or run["res_path"], str(yaml_file),
                                                model_source=state.get("model_source"))
    except Exception as exc:  # reported like the collector script reports it, one line
        from agent.errors import filesystem_fault

        fault = filesystem_fault(exc, recipe.path)      # a read-only / immutable / full recipe: exit 74
        if fault is not None:
            raise fault from None
        raise MigratorError(f"baseline collection failed: {baseline.error_line(exc)}") from None
    # A stand-in baseline never replaces an NPU one: named from what it records (baseline.file_name).
    name = baseline.file_name(collected, standin=bool(state.get("upstream_standin")))
    # upstream's own recipe checked under the stand-in: only under its ignored res/ (our state folder)
    folder = state_dir(recipe.path) / "baseline" if state.get("upstream_standin") else recipe.baseline_dir()
    return {"baseline_path": str(folder / name), "baseline": collected}


def node_verify(state: MigrationState) -> dict:
    """The collected baseline with parity and the output checks, written to baseline_path (its one
    write); abnormal output goes back to diagnosis as a failed run."""
    baseline_path = Path(state["baseline_path"])
    # A store of an earlier release, whose collect node wrote the file, has no baseline in its state.
    collected = state.get("baseline") or load_json(baseline_path)
    checked = verify.verify(Recipe.at(state["recipe_dir"]), last_run(state), collected,
                            bool(state.get("trust_remote_code")), state.get("upstream_standin"),
                            python=recipe_python(state), ours=bool(state.get("vendored")))
    recipe_dir = Path(state["recipe_dir"])
    # inside a checkout the previous baseline goes to our ignored state folder; the README of a recipe
    # this tool wrote (never upstream's own) gets its product and performance sections from the baseline
    ours = not state.get("upstream_standin") and bool(state.get("vendored") or Recipe.at(recipe_dir).report().get("vendored"))
    baseline.write_baseline(baseline_path, checked,
                            previous_dir=state_dir(recipe_dir) if checkout_root(recipe_dir) else None,
                            recipe_dir=recipe_dir if ours else None)
    problems = verify.problems(checked)
    update = {"verification": checked["verification"], "status": "failed" if problems else "ok"}
    if problems:
        update["message"] = "; ".join(problems)
    if (again := verify.abnormal_output_run(last_run(state), checked)) is not None:
        update["runs"] = [again]
    return update


def node_report(state: MigrationState) -> dict:
    write_report(state)
    return {}


def node_give_up(state: MigrationState) -> dict:
    last = state["rounds"][-1]
    diagnosis = last["diagnosis"]
    where = f" at {diagnosis['location']}" if diagnosis.get("location") else ""
    # A rule that only reports (e.g. the pip install line) says what to do in its note.
    note = f"; {last['note']}" if last.get("note") and last.get("note") != "no repair rule matched" else ""
    return {"status": "failed", "message": f"{diagnosis['diagnosis']}{where}{note}"}
