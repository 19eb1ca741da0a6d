"""The workflow's nodes: each takes the state (and, when it needs a run option, the graph's config)
and returns the keys it changes, a partial MigrationState (SPEC §2). The work is done by the modules of
the scenario it belongs to; a node only reads the state and calls them. What the user gave was checked
once, before the graph started (agent.workflow.inputs): no node checks it again."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

from langchain_core.runnables import RunnableConfig

from agent.errors import EnvironmentProblem, InputError, MigratorError
from agent.measure import baseline, memory, quant_cost, verify
from agent.migrate.acquire import acquire
from agent.migrate import convert, transformers_source
from agent.migrate.checkpoint_check import check_checkpoint, check_output_outside
from agent.quantization_formats import is_w8a8
from agent.run.trial_run import trial_run
from agent.migrate.vendor import auto_map_served_natively, locate_source, read_config, vendor_source
from agent import folder_lock
from agent.recipe.fs_guard import user_tree
from agent.recipe.recipe import Recipe, RunPlan
from agent.recipe.registry import register, registered_names, unregister
from agent.recipe.render import normalise_model_name, render_recipe, template_context
from agent.recipe.targets import (REGISTRY, TARGETS, checkout_root, default_target, framework_names, state_dir,
                                  state_parts)
from agent.recipe.routing import route
from agent.recipe.spec import RecipeSpec
from agent.run import plan as run_plan
from agent.repair.diagnose import diagnose
from agent.repair.fix import repair
from agent.repair.rules.rule import RepairContext
from agent.workflow.inputs import host_environment
from agent.workflow.report import write_report
from agent.workflow.state import MigrationState, last_run, run_options, standin_run
from agent.workflow.store import drop_staging, held_run_checkpoints, publish, restore_run_checkpoints, staging_dir
from engine import defaults
from engine.safe_load import load_json
from npu_standin import honest


def node_detect_env(state: MigrationState, config: RunnableConfig) -> MigrationState:
    return {"env": host_environment(run_options(config)["device"])}


def node_classify(state: MigrationState, config: RunnableConfig) -> MigrationState:
    """A checkpoint, or no recipe -> A; a recipe (agent.recipe.recipe) that runs -> C; one that fails -> B.
    Nothing inside a checkpoint is run, even an infer.sh. Whether this host can run the recipe was
    settled by the input step (agent.workflow.inputs.preflight)."""
    recipe = Recipe.at(state["target"]) if Path(state["target"]).expanduser().exists() else None
    if recipe is None or not recipe.is_recipe:
        reason = "no infer.sh: migrate the model into a new recipe"
        if recipe is not None and recipe.kind == "checkpoint" and (recipe.path / "infer.sh").exists():
            reason = ("a checkpoint (config.json and weights): its infer.sh is not run; "
                      "migrate the model into a new recipe")
        return {"scenario": "A", "classify_reason": reason}
    plan = plan_run(recipe, state)          # before anything runs: a --world-size it cannot run is refused here
    run = _needs_npu(trial_run(recipe, "classify", plan, run_options(config)["timeout_s"],
                               python=recipe_python(state, recipe)))
    how = f"{recipe.reason} and it runs" if run["ok"] else f"{recipe.reason} but it fails: {run['summary']}"
    return {"scenario": "C" if run["ok"] else "B", "classify_reason": how, "recipe_dir": str(recipe.path),
            "run_plan": plan, "runs": [run]}


def plan_run(recipe: Recipe, state: MigrationState) -> dict:
    """The run plan (agent.recipe.recipe.RunPlan) every trial run, the baseline, the precision check and
    the memory estimate of this migration read, decided once (agent.run.plan): the --standin plan the
    input step made, else the recipe's YAML for --world-size (None: its own) on the checkpoint migrated from."""
    if standin_run(state):
        return RunPlan.from_dict(state["run_plan"]).as_dict()
    return run_plan.plan_run(recipe, state.get("world_size"), weights=state.get("model_dir")).as_dict()


def current_plan(state: MigrationState, recipe: Recipe) -> RunPlan:
    """The plan of this migration's runs (a store of an earlier release has none: decided now)."""
    return RunPlan.from_dict(state.get("run_plan") or plan_run(recipe, state))


def node_acquire(state: MigrationState) -> MigrationState:
    got = acquire(state["target"], weights=state.get("weights"))
    # downloaded from a hub: checked here, where it arrived, before anything is written (exit 2); a
    # local checkpoint was checked by the input step (agent.workflow.inputs)
    downloaded = not Path(state["target"]).expanduser().is_dir()
    if downloaded:
        check_checkpoint(Path(got.model_dir), bool(state.get("trust_remote_code")))
    name = normalise_model_name(state["name"], explicit=True) if state.get("name") \
        else normalise_model_name(got.name_hint)
    output_dir = Path(state.get("output_dir") or "models").resolve()
    if downloaded:
        check_output_outside(Path(got.model_dir), output_dir, str(state.get("output_dir")))
    recipe_dir = output_dir / name
    # made in the output folder's tree: a link in its place that leads out (to a folder or to nothing) is refused
    user_tree(output_dir, "the output folder").resolve(recipe_dir, "mkdir")
    if os.path.lexists(recipe_dir) and not recipe_dir.is_dir():      # a file, a FIFO, a link to nothing
        raise InputError(f"{recipe_dir} exists and is not a folder; move it away, or choose another --name / "
                         "--output-dir")
    folder_lock.hold(recipe_dir, "run it")    # another migration into this folder, of any source: refused (exit 75)
    if held_run_checkpoints(recipe_dir) is not None:
        # all a migration killed before publishing its recipe left (its lock is ours now): made again
        print(f"[migrator] {recipe_dir}: removing the checkpoint an interrupted migration wrote for it",
              file=sys.stderr)
        user_tree(output_dir, "the output folder").rmtree(recipe_dir)
    if recipe_dir.exists() and any(recipe_dir.iterdir()):
        raise InputError(f"{recipe_dir} already exists; run `migrator run {recipe_dir}` to repair or "
                         "re-baseline it, or choose another --name / --output-dir")
    # the input step chose and checked it; a state built without it (a store of an earlier release): the default
    recipe_target = state.get("recipe_target") or default_target(output_dir)
    if TARGETS[recipe_target].registry_entry is not None:
        registry = checkout_root(output_dir) / REGISTRY
        if name in registered_names(registry):
            raise InputError(f"{registry} registers {name!r} already; choose another --name")
    plan = transformers_plan(state, output_dir, recipe_target)
    TARGETS[recipe_target].check_checkpoint(Path(got.model_dir))   # e.g. a base model upstream's scheduler cannot take
    if plan["origin"]:
        print(f"[migrator] vendoring from {plan['origin']} (the checkout's; {transformers_source.installed_version()} "
              f"is installed); trial runs and parity with {plan['python']}", file=sys.stderr)
    extra = {}
    if state.get("quantize"):
        from agent.migrate import quantize

        if downloaded:
            quantize.plan(Path(got.model_dir))      # a hub checkpoint it cannot convert: refused before any write
        written = quantize.for_migration(state["quantize"], Path(got.model_dir), recipe_dir, output_dir)
        cost = quant_cost.of_written(written)
        print(f"[migrator] cost of quantizing: {quant_cost.line(cost)}", file=sys.stderr, flush=True)
        extra["quantization"] = {**written, "cost": cost}
        model_dir = Path(extra["quantization"]["checkpoint"])     # the migration runs the checkpoint written
    else:
        # a format the NPU cannot compute (fp8, mxfp4, awq, gptq, ...): converted to bf16 in the recipe's state
        # folder; a repo whose auto_map transformers serves: a view without it (the launcher would run the repo's code)
        model_dir, conversion = convert.for_recipe(Path(got.model_dir), recipe_dir,
                                                   trust_remote_code=bool(state.get("trust_remote_code")))
        if conversion:
            extra["conversion"] = conversion
    # the source's auto_map, served by transformers' class (the checkpoint the recipe runs no longer names it)
    note = None if state.get("trust_remote_code") else auto_map_served_natively(read_config(Path(got.model_dir)))
    if note:
        extra["auto_map_note"] = note
    return {"model_dir": str(model_dir), "model_source": got.source, "model_name": name,
            "recipe_dir": str(recipe_dir), "recipe_target": recipe_target, "transformers": plan, **extra}


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
    """A failed vendor/render leaves no half-built recipe behind to block the next run: its staging folder
    goes, and the recipe folder too when this run published it (it did not exist or was empty before:
    node_acquire checked), with its registry line. Anything else in its place is not this run's to remove."""
    @functools.wraps(node)
    def wrapper(state: MigrationState, **config) -> MigrationState:
        try:
            return node(state, **config)
        except BaseException:
            recipe_dir = Path(state["recipe_dir"])
            thread = ((config.get("config") or {}).get("configurable") or {}).get("thread_id") or ""
            undo = [lambda: drop_staging(recipe_dir)]
            if _rendered_by(recipe_dir, thread) is not None:
                undo += [lambda: unregister(state_dir(recipe_dir)),
                         lambda: user_tree(recipe_dir.parent, "the output folder").rmtree(recipe_dir)]
            elif held_run_checkpoints(recipe_dir) is not None:       # what acquire wrote for the recipe to run
                undo.append(lambda: user_tree(recipe_dir.parent, "the output folder").rmtree(recipe_dir))
            for step in undo:
                try:
                    step()
                except (OSError, ValueError, MigratorError):
                    pass      # the node's own error is the one to report
            raise

    return wrapper


@removes_half_built_recipe
def node_vendor(state: MigrationState) -> MigrationState:
    """The model's source, vendored into the recipe's staging folder (agent.workflow.store): nothing
    appears in the output folder until render publishes the whole recipe."""
    model_dir, recipe_dir = Path(state["model_dir"]), Path(state["recipe_dir"])
    config = read_config(model_dir)
    source = locate_source(config, model_dir, trust_remote_code=bool(state.get("trust_remote_code")))
    target = TARGETS[state["recipe_target"]]
    plan = state.get("transformers") or {}
    tree = transformers_source.SourceTree(plan["version"], Path(plan["source_root"]), plan["origin"]) \
        if plan.get("source_root") else None
    drop_staging(recipe_dir)        # what a killed attempt left: written again whole
    staging = staging_dir(recipe_dir)
    result = vendor_source(source, staging, state["model_name"],
                           target.vendored_package.format(name=state["model_name"]), tree=tree,
                           model_source=state.get("model_source"), model_dir=model_dir)
    vendored = result.vendored(staging)
    note = source.note or state.get("auto_map_note")
    if note:
        vendored["auto_map_note"] = note
        print(f"[migrator] {source.architecture}: {note}", file=sys.stderr)
    if source.text_decoder_note:
        print(f"[migrator] {source.architecture}: {source.text_decoder_note}", file=sys.stderr)
    if plan.get("version"):
        vendored["transformers_version"] = plan["version"]
    return {"architecture": source.architecture, "family": route(config.get("text_config") or config).name,
            "vendored": vendored}


def recipe_spec(state: MigrationState, config: RunnableConfig) -> RecipeSpec:
    """The new recipe's spec (agent.recipe.spec): what render writes and what the native decision is made for."""
    model_dir = Path(state["model_dir"])
    return RecipeSpec.for_checkpoint(
        model_name=state["model_name"], model_dir=model_dir, model_source=state["model_source"],
        architecture=state["architecture"], family=state["family"], vendored=state["vendored"],
        config=read_config(model_dir), device=run_options(config)["device"], dtype=state.get("dtype"),
        max_new_tokens=state.get("max_new_tokens"), world_size=state.get("world_size"))


def native_decision(state: MigrationState, config: RunnableConfig) -> MigrationState:
    """Native or adapter for a target whose model file is chosen per recipe (the framework row), decided once
    per migration (agent.recipe.native.decide): the architecture's parts, the native file written from them and
    held to transformers in a stand-in subprocess; any step that fails keeps the adapter, with the layer kind
    and the reason. The state records the summary (`native_model`: the report's and README's) and the file
    its self-check ran (`native_source`), which render writes as it is."""
    from agent.recipe.native.decide import decide

    if not TARGETS[state["recipe_target"]].writes_native_models:
        return {}
    recipe_dir = Path(state["recipe_dir"])
    try:
        model_config = load_json(Path(state["model_dir"]) / "config.json")
    except (OSError, ValueError):
        return {}
    if not isinstance(model_config, dict):
        return {}
    spec_context = recipe_spec(state, config).context()
    ctx = {**spec_context, **framework_names(spec_context), "recipe_dir": str(recipe_dir)}
    decision = decide(ctx, model_config, checkout_root(recipe_dir))
    return {"native_model": decision.summary(), **({"native_source": decision.source} if decision.source else {})}


@removes_half_built_recipe
def node_decide_native(state: MigrationState, config: RunnableConfig) -> MigrationState:
    """The native-or-adapter decision, in its own step between vendor and render (see native_decision)."""
    return native_decision(state, config)


RENDERED = "rendered.json"      # in a published recipe's state folder: the render node's result and its run


CONVERSION_HEADING = "## 权重转换 (quantized checkpoint converted)"


def conversion_readme(conversion: dict) -> str:
    """The recipe README's account of a converted checkpoint: what, why, where, and the command that redoes it
    (upstream's new_model_checklist: quantization config-driven, the converter documented); upstream's own
    converter of the same checkpoint where one reads it."""
    upstream = conversion.get("upstream_converter")
    return (f"The published checkpoint ({conversion['source']}) holds {conversion['format']} weights; "
            f"{conversion['why']}. The migration wrote the {conversion['dtype']} checkpoint the YAML's `model_path` "
            f"should name:\n\n    {conversion['path']}\n\n"
            f"({conversion['tensors']['quantized']} tensors dequantized, {conversion['tensors']['kept']} kept as "
            "published, `quantization_config` removed from its config.json). To convert again, e.g. on the NPU host:"
            f"\n\n```bash\n{conversion['command']}\n```\n" +
            (f"\ncann-recipes-infer's own converter reads this checkpoint too (from the checkout's root):\n\n"
             f"```bash\n{upstream}\n```\n" if upstream else ""))


@removes_half_built_recipe
def node_render(state: MigrationState, config: RunnableConfig) -> MigrationState:
    """The recipe's files, written into the staging folder beside the vendored ones and published whole
    (agent.workflow.store.publish), then its registry line where the target has one. Resumed after a kill
    that came once the recipe was published, it registers and answers what it answered then."""
    recipe_dir, model_dir = Path(state["recipe_dir"]), Path(state["model_dir"])
    restore_run_checkpoints(recipe_dir)         # a publish killed half way gave them to the staging folder
    thread = config.get("configurable", {}).get("thread_id") or ""
    spec = recipe_spec(state, config)
    target = TARGETS[state["recipe_target"]]
    # the decision decide_native recorded (a store of an earlier release, resumed here, has none: made now, once)
    recorded = state if "native_model" in state or not target.writes_native_models else native_decision(state, config)
    native = {"native_decision": recorded.get("native_model"), "native_source": recorded.get("native_source")}
    done = _rendered_by(recipe_dir, thread)
    if done is None:
        staging = staging_dir(recipe_dir)
        if not (staging / "models").is_dir():
            raise InputError(f"{recipe_dir}: the vendored files of this interrupted migration are gone ({staging}); "
                             "run the same command without --resume to start again")
        written = render_recipe(recipe_dir, {**spec.context(), **native}, spec.family_spec(), target, write_to=staging)
        if state.get("conversion"):
            memory.add_readme_section(staging, CONVERSION_HEADING, conversion_readme(state["conversion"]))
        done = {"rendered": [str(p.relative_to(staging)) for p in written], "registry_entry": None}
        if target.registry_entry is not None:
            ctx = template_context(dict(spec.context(), recipe_dir=str(recipe_dir), **native), spec.family_spec(), target)
            done["registry_entry"] = [list(pair) for pair in target.registry_entry(ctx)]
            if native["native_decision"]:
                done["native_model"] = native["native_decision"]
        marker = staging.joinpath(*state_parts(recipe_dir), RENDERED)
        user_tree(staging, "the staging folder").write_text(marker, json.dumps({"thread": thread, **done}) + "\n")
        publish(staging, recipe_dir)
    entry = done.pop("registry_entry")
    if target.registry_entry is not None:
        # the one change outside the recipe: its line in the checkout's registry (backed up, undone by rollback)
        edit = register(checkout_root(recipe_dir), spec.model_name, [tuple(pair) for pair in entry],
                        state_dir(recipe_dir))
        print(f"[migrator] registered {spec.model_name} in {edit.registry} (before: {edit.backup})", file=sys.stderr)
        decision = done.get("native_model")
        if decision:
            print("[migrator] framework model: " + ("native (upstream's layers and fused kernels)" if decision["native"]
                  else f"adapter ({decision['fell_back']} fell back: {decision['reason']})"), file=sys.stderr)
        if is_w8a8(read_config(model_dir)) and not (decision or {}).get("quant_config"):
            # issue 43 item 2: until the generated model passes quant_config to its linears (as upstream's do),
            # the int8 weights load as floats and the precision check fails at the first layer
            print("[migrator] the framework model does not thread quant_config yet: the W8A8 checkpoint's int8 "
                  "weights load as floats (the precision check will say where it diverges)", file=sys.stderr)
    update = {key: recorded[key] for key in ("native_model", "native_source") if recorded is not state and key in recorded}
    return {**done, **update, "run_plan": plan_run(Recipe.at(recipe_dir), state)}


def _rendered_by(recipe_dir: Path, thread: str) -> dict | None:
    """The render node's result when this run (`thread`) published `recipe_dir` already (a kill came before
    the store saved it), else None. Read as untrusted: only this run's own marker, of the expected shape."""
    marker = state_dir(recipe_dir) / RENDERED
    if not thread or not marker.is_file() or marker.is_symlink():
        return None
    try:
        data = load_json(marker, max_bytes=2**20)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("thread") != thread:
        return None
    rendered, native, entry = data.get("rendered"), data.get("native_model"), data.get("registry_entry")
    pairs = entry is None or (isinstance(entry, list) and all(
        isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair) for pair in entry))
    if not (isinstance(rendered, list) and all(isinstance(r, str) for r in rendered)) or not pairs \
            or not (native is None or isinstance(native, dict)):
        return None
    return {"rendered": rendered, "registry_entry": entry, **({"native_model": native} if native else {})}


def node_trial_run(state: MigrationState, config: RunnableConfig) -> MigrationState:
    recipe = Recipe.at(state["recipe_dir"])
    # the plan classify or render decided (a store of an earlier release has none: decided now, once)
    plan = state.get("run_plan") or plan_run(recipe, state)
    run = trial_run(recipe, f"trial{len(state.get('rounds') or [])}", plan, run_options(config)["timeout_s"],
                    python=recipe_python(state, recipe))
    return {"runs": [_needs_npu(run)], "run_plan": plan}


def recipe_python(state: MigrationState, recipe: Recipe) -> str | None:
    """The interpreter the recipe runs with when it is not this one (another transformers): this run's
    --reference-python, else the one its migration ran it with (its report), while it exists."""
    python = (state.get("transformers") or {}).get("python") or state.get("reference_python")
    if python or not recipe.path.is_dir():
        return python
    stored = (recipe.report().get("transformers") or {}).get("python")
    return stored if stored and Path(stored).is_file() else None


def _needs_npu(run):
    """A stand-in run that called an op without a reference kernel: only an NPU can run it (exit 4)."""
    if run.get("standin_unsupported"):
        raise EnvironmentProblem(f"needs an Ascend NPU: {run['standin_unsupported']}")
    return run


def node_diagnose(state: MigrationState) -> MigrationState:
    diagnosis = diagnose(Path(state["recipe_dir"]), last_run(state))
    return {"rounds": [{"round": len(state.get("rounds") or []) + 1, "diagnosis": diagnosis}]}


def node_repair(state: MigrationState, config: RunnableConfig) -> MigrationState:
    context = RepairContext(allow_install=bool(state.get("allow_install")),
                            timeout_s=run_options(config)["timeout_s"] or defaults.TIMEOUT_S,
                            trust_remote_code=bool(state.get("trust_remote_code")))
    last = state["rounds"][-1]
    # The fix sees the failure diagnose saw: rebuilt from the same run record.
    done = repair(Path(state["recipe_dir"]), last["diagnosis"], round_no=last["round"], context=context,
                  run=last_run(state))
    return {"rounds": [{**last, **done}]}


def node_estimate_memory(state: MigrationState) -> MigrationState:
    """After an out-of-memory run: the estimate per rank for tp = 1, 2, 4, ... 16 against one card;
    the single-card recipe is kept and the smallest N that fits is written as an N-card YAML."""
    recipe = Recipe.at(state["recipe_dir"])
    estimate = memory.estimate_for_recipe(recipe, state.get("env") or {}, current_plan(state, recipe))
    return {"memory": estimate, "status": "oom", "message": memory.out_of_memory(recipe, estimate)}


def node_collect_baseline(state: MigrationState) -> MigrationState:
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
    # A stand-in baseline never replaces an NPU one: named from what it records (npu_standin.honest).
    name = honest.baseline_file_name(collected, standin=standin_run(state))
    # upstream's own recipe checked under the stand-in: only under its ignored res/ (our state folder)
    folder = state_dir(recipe.path) / "baseline" if standin_run(state) else recipe.baseline_dir()
    return {"baseline_path": str(folder / name), "baseline": collected}


def node_verify(state: MigrationState) -> MigrationState:
    """The collected baseline with parity and the output checks, written to baseline_path (its one
    write); abnormal output goes back to diagnosis as a failed run."""
    baseline_path = Path(state["baseline_path"])
    # A store of an earlier release, whose collect node wrote the file, has no baseline in its state.
    collected = state.get("baseline") or load_json(baseline_path)
    recipe = Recipe.at(state["recipe_dir"])
    checked = verify.verify(recipe, last_run(state), collected, bool(state.get("trust_remote_code")),
                            current_plan(state, recipe), python=recipe_python(state, recipe),
                            ours=bool(state.get("vendored")))
    recipe_dir = Path(state["recipe_dir"])
    # inside a checkout the previous baseline goes to our ignored state folder; the README of a recipe
    # this tool wrote (never upstream's own) gets its product and performance sections from the baseline
    ours = not standin_run(state) and bool(state.get("vendored") or recipe.report().get("vendored"))
    baseline.write_baseline(baseline_path, checked,
                            previous_dir=state_dir(recipe_dir) if checkout_root(recipe_dir) else None,
                            recipe_dir=recipe_dir if ours else None)
    problems = verify.problems(checked)
    update = {"verification": checked["verification"], "status": "failed" if problems else "ok"}
    if problems:
        update["message"] = "; ".join(problems)
    elif unverified := verify.not_checked(checked):     # an ok run names every check that gave no verdict
        update["message"] = "not checked: " + "; ".join(unverified)
    if (again := verify.abnormal_output_run(last_run(state), checked, recipe_dir)) is not None:
        update["runs"] = [again]
    return update


def node_report(state: MigrationState) -> MigrationState:
    write_report(state)
    return {}


def node_give_up(state: MigrationState) -> MigrationState:
    last = state["rounds"][-1]
    diagnosis = last["diagnosis"]
    where = f" at {diagnosis['location']}" if diagnosis.get("location") else ""
    # A rule that only reports (e.g. the pip install line) says what to do in its note.
    note = f"; {last['note']}" if last.get("note") and last.get("note") != "no repair rule matched" else ""
    return {"status": "failed", "message": f"{diagnosis['diagnosis']}{where}{note}"}
