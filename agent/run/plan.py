"""The plan of every run of a recipe, built once (`plan_run`) and read by trial runs, the precision
check, the memory estimate, the baseline and the report: agent.recipe.recipe.RunPlan.

`Recipe.run_plan` answers which of the recipe's YAMLs and how many ranks; `plan_run` adds on which
weights and whether under the npu stand-in. Where the YAML's `model_path` is not a checkpoint here —
upstream's placeholder (`your_model_path`, checklist 二.4, the form every YAML this tool writes into a
checkout has), or a path of the NPU host — the run gets a *copy* of the YAML with the real path filled
in (and, on a tiny random checkpoint, its lengths cut), in our state folder
(agent.recipe.targets.state_dir; `res/.migrator/` in a checkout, which upstream's .gitignore keeps out
of `git status`). The recipe's own files are never edited for a run. The real path comes from
`weights` (the checkpoint a migration vendored from), the recipe's report (its `model_dir`) — for a
target whose YAMLs carry the placeholder (Target.model_path_placeholder: framework, legacy) — or, under
the stand-in, `--tiny`. A standalone recipe's YAML names its weights itself: it runs as it is.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import replace
from pathlib import Path

import yaml as yamllib

from agent.errors import EnvironmentProblem, InputError
from agent.recipe.recipe import Recipe, RunPlan, read_settings
from agent.recipe.targets import state_dir
from engine.safe_load import load_yaml
from agent.recipe.fs_guard import user_tree

TINY_INPUT_LEN = 128
TINY_MAX_BATCH = 4
TP_KEYS = ("attn_tp_size", "moe_tp_size", "lmhead_tp_size")
QUANTIZED_YAML = re.compile(r"w8a8|a8w8|w4a8|int8", re.I)
# the most ranks a stand-in run is moved to when the recipe's code does not run at the ranks it defaults to
MAX_FIT_RANKS = 2


def plan_run(recipe: Recipe, world_size: int | None = None, *, yaml_name: str | None = None,
             weights: str | Path | None = None, standin: str | None = None, tiny: bool = False,
             max_new_tokens: int = 16, quantize: str | None = None, fit_ranks: bool = False) -> RunPlan:
    """The run plan (see the module docs). `standin`: the stand-in's device (None: not under the
    stand-in); `yaml_name`: a file of config/ to run (a --standin run; default: Recipe.run_plan's);
    `fit_ranks`: `world_size` is a default, not asked for (a --standin run's one rank), so a recipe whose
    code does not run there may be moved to up to MAX_FIT_RANKS (fit_layout).
    InputError (exit 2) for a YAML that is not there, a layout the recipe's code cannot run, or weights
    that are absent without --tiny under the stand-in; EnvironmentProblem (exit 4) where the stand-in
    must not run."""
    if standin is not None:
        check_standin(recipe, standin)
    if yaml_name is not None:
        source = named_yaml(recipe, yaml_name)
        base = RunPlan(source, world_size or recipe.target.schema.world_size(read_settings(source)) or 1)
    else:
        # under the stand-in upstream's config/ is never written: a YAML for other ranks is scaled in the copy
        base = recipe.run_plan(world_size, write=standin is None)
    layout_notes: tuple[str, ...] = ()
    if standin is not None:
        base, layout_notes = fit_layout(recipe, base, fixed_yaml=yaml_name is not None, fit_ranks=fit_ranks)
    schema = recipe.target.schema
    settings = read_settings(base.yaml)
    written = schema.get(settings, "model_path")
    own = recipe.resolve(written)
    plan = replace(base, source_yaml=base.yaml, standin=standin)
    notes: list[str] = list(layout_notes)
    ranks = schema.world_size(settings) or 1
    # a target whose YAMLs carry a placeholder gets the real path at run time; a standalone YAML names its
    # weights itself (a wrong one is a fault its repair fixes in the YAML, never hidden by a copy)
    fills = recipe.target.model_path_placeholder is not None
    if quantize and not (standin is not None and tiny):
        raise InputError(f"--quantize {quantize} on a recipe writes the stand-in's tiny checkpoint so; pass --standin --tiny")
    if own is not None and (own / "config.json").is_file():
        if quantize:
            raise InputError(f"--quantize {quantize}: {base.yaml.name}'s model_path {written!r} holds weights, which the "
                             "run takes as they are; --quantize writes a tiny checkpoint where the weights are not here")
        checkpoint, how = own, f"weights: {own} (the YAML's model_path)"
    elif fills and weights is not None and (Path(weights) / "config.json").is_file():
        checkpoint, how = Path(weights).resolve(), f"weights: {weights} (the YAML's model_path is {written!r})"
    elif fills and (stored := recipe.report().get("model_dir")) and (Path(stored) / "config.json").is_file():
        checkpoint, how = Path(stored), f"weights: {stored} (the migration's checkpoint; the YAML's model_path is {written!r})"
    elif standin is not None and not tiny:
        old = [line for line in old_schema_keys(recipe, base.yaml) if "'model_path'" in line]
        raise InputError(f"{base.yaml.name}: " + (old[0] if old else
                         f"model_path {written!r} is not here (the weights live on the NPU host); pass --tiny "
                         "to run the recipe on a tiny random checkpoint of its own architecture, or point "
                         "model_path at local weights"))
    elif standin is not None:
        from agent.recipe.model_type import recipe_model_type
        from agent.run.standin import build_tiny

        model_type = recipe_model_type(recipe, settings)
        print(f"[migrator] --tiny: a tiny random {model_type} checkpoint in {state_dir(recipe.path) / 'standin'} "
              f"({written!r} is not here)", file=sys.stderr, flush=True)
        checkpoint = build_tiny(recipe, model_type)
        how = f"weights: tiny random {model_type} checkpoint {checkpoint} (the YAML's model_path {written!r} is not here)"
        if quantize:
            from agent.run.standin import quantize_tiny

            checkpoint = quantize_tiny(recipe, checkpoint, quantize)
            how += f", written {quantize.upper()} (--quantize): {checkpoint}"
        elif QUANTIZED_YAML.search(base.yaml.name):
            notes.append(f"{base.yaml.name} names a quantized checkpoint and the tiny one is float: the run takes the "
                         "float path; --quantize w8a8 writes the tiny checkpoint W8A8")
            print(f"[migrator] --tiny: {notes[-1]}", file=sys.stderr, flush=True)
        plan = replace(plan, tiny=True, model_type=model_type)
    else:
        # nothing to fill in: the run goes as the recipe is (a repair may point model_path at weights)
        return replace(plan, notes=tuple(notes))
    notes.append(how)
    plan = replace(plan, checkpoint=checkpoint)
    if recipe.target.writes_native_models:
        # a native framework model whose heads or widths do not split at the run's tensor-parallel sizes:
        # refused here, one line, before anything is written or run (agent.recipe.native.preflight)
        from agent.recipe.native import preflight

        at_ranks = dict(settings)
        # the YAML scaled in the run's copy to more ranks than it sets, of a native MoE model: the experts expert
        # parallel, as upstream lays them out (parallel_for would make them tensor parallel); a YAML for these
        # ranks runs as it is written
        scaled = yaml_name is None and plan.world_size > ranks and plan.parallel is None
        expert = recipe.expert_parallel_layout(plan.world_size, checkpoint) if scaled else None
        if expert is not None:
            plan = replace(plan, parallel=expert["parallel_config"])
            notes.append(f"{plan.world_size} ranks: {expert['how']}")
        if isinstance(settings.get("parallel_config"), dict):
            at_ranks["parallel_config"] = plan.parallel or parallel_for(settings["parallel_config"], plan.world_size)
        preflight.check(recipe.path, checkpoint, at_ranks, base.yaml.name)
    if checkpoint == own and ranks == plan.world_size and plan.parallel is None:
        return replace(plan, notes=tuple(notes))           # the recipe's YAML as it is
    plan = replace(plan, yaml=copy_path(recipe, base.yaml, standin is not None),
                   max_new_tokens=max_new_tokens if plan.tiny else None)
    write_copy(recipe, plan)
    notes.append(f"ran a copy of {base.yaml.name}: {_shown(recipe, plan.yaml)} (the recipe's files untouched)")
    dataset = schema.get(settings, "dataset") or "default"
    if plan.tiny and dataset != "default":
        notes.append(f"dataset {dataset!r} -> 'default' (the checkout's default prompt) in the copy")
    return replace(plan, notes=tuple(notes))


def check_standin(recipe: Recipe, device: str) -> None:
    from npu_standin.launcher import StandinRefused, check_can_run

    if not recipe.target.standin_runnable:
        raise InputError(f"{recipe.path}: --standin runs a cann-recipes-infer recipe (a models/NAME folder of a "
                         f"checkout, or a recipe with its own infer.sh); this is {recipe.kind} ({recipe.reason})")
    try:
        check_can_run(device)
    except StandinRefused as exc:
        raise EnvironmentProblem(str(exc)) from None
    from agent.recipe import compiled_ops

    certain, _ = compiled_ops.scan(recipe)
    if certain:
        raise EnvironmentProblem(compiled_ops.message(certain))


def named_yaml(recipe: Recipe, yaml_name: str) -> Path:
    config = recipe.path / "config"
    path = (config / yaml_name).resolve()
    if not path.is_file() or config.resolve() not in path.parents:
        available = sorted(p.relative_to(config).as_posix() for p in config.rglob("*.y*ml") if p.is_file()) \
            if config.is_dir() else []
        raise InputError(f"--yaml {yaml_name}: no such file in {config} (there: {', '.join(available) or 'none'})")
    return path


def copy_path(recipe: Recipe, source: Path, standin: bool) -> Path:
    """Where a run's copy of `source` goes: our state folder, `standin/config/` for a stand-in run
    (repairs of it edit the copy, never upstream's file), else `plan/config/` (written again from the
    recipe's YAML before every run, so a repair of the recipe's YAML is what runs)."""
    return state_dir(recipe.path) / ("standin" if standin else "plan") / "config" / source.name


def parallel_for(parallel: dict, world_size: int) -> dict:
    """parallel_config for `world_size` ranks. Fewer ranks than the YAML's: each *_size above 1
    becomes the largest divisor of world_size it does not exceed (the layout kept, scaled down). More
    (a single-card YAML on N): attention, MoE and lm_head tensor parallel over all of them, as
    upstream's N-card YAMLs are (embedding and dense TP as the YAML has them)."""
    out = dict(parallel)
    before = int(parallel.get("world_size") or 1)
    out["world_size"] = world_size
    if world_size > before:
        for key in TP_KEYS:
            out[key] = world_size
        return out
    for key, value in parallel.items():
        if key != "world_size" and key.endswith("_size") and isinstance(value, int) and value > 1:
            out[key] = max(d for d in range(1, world_size + 1) if world_size % d == 0 and d <= value)
    return out


def tensor_parallel(parallel: dict, world_size: int) -> dict:
    """parallel_config with attention, MoE and lm_head tensor parallel over all `world_size` ranks (so
    moe_ep_size = world_size // moe_tp_size = 1), embedding as parallel_for scales it."""
    return {**parallel_for(parallel, world_size), **{key: world_size for key in TP_KEYS}}


def _all_tensor_parallel(parallel: dict) -> bool:
    world = parallel.get("world_size")
    return isinstance(world, int) and world > 1 and all(parallel.get(key, 1) == world for key in TP_KEYS[:2])


def fit_layout(recipe: Recipe, base: RunPlan, *, fixed_yaml: bool, fit_ranks: bool) -> tuple[RunPlan, tuple[str, ...]]:
    """A stand-in run's layout that the recipe's own code runs (agent.recipe.layouts), decided before
    anything runs. The YAML scaled to the plan's ranks (parallel_for) when its code runs there; else,
    at those ranks and then — where the ranks were a default (`fit_ranks`) — at up to MAX_FIT_RANKS:
    each of config/'s YAMLs that is tensor parallel over all its ranks (not with `fixed_yaml`, a
    --yaml run), then the plan's YAML made tensor parallel over the ranks, then the plan's YAML scaled.
    Tensor parallel first: the YAML the user would run is changed least (its expert-parallel path over
    several ranks runs too, through the stand-in's MC2 kernels, when asked for with --yaml / --world-size),
    and at one rank upstream's MoE recipes get a group they register only for more (models/qwen3_moe's
    moe_ep_group). A layout none of these gives: InputError, one line."""
    from agent.recipe import layouts

    parallel = read_settings(base.yaml).get("parallel_config")
    if not isinstance(parallel, dict):
        return base, ()
    code = layouts.CodeFacts.of(recipe.path)
    asked = parallel_for(parallel, base.world_size)
    found = layouts.problems(code, asked)
    if not found:
        return base, ()
    why = f"its code does not run at {layouts.describe(asked)}: {found[0]}" + \
        (f" (and {len(found) - 1} more group(s): {', '.join(line.split(chr(39))[1] for line in found[1:])})"
         if len(found) > 1 else "")
    others = [] if fixed_yaml else [path for path in sorted((recipe.path / "config").glob("*.y*ml"))
                                    if path.is_file() and path != base.yaml
                                    and _all_tensor_parallel(read_settings(path).get("parallel_config") or {})]
    ranks = [base.world_size] + ([MAX_FIT_RANKS] if fit_ranks and base.world_size < MAX_FIT_RANKS else [])
    for world_size in ranks:
        candidates = [(path, parallel_for(read_settings(path)["parallel_config"], world_size)) for path in others]
        candidates += [(base.yaml, tensor_parallel(parallel, world_size)), (base.yaml, parallel_for(parallel, world_size))]
        for source, layout in candidates:
            if not layouts.problems(code, layout):
                shown = _shown(recipe, source)
                note = (f"{recipe.path.name}: {why}; running {shown} at {layouts.describe(layout)} instead, a "
                        "layout its code runs")
                print(f"[migrator] {note}", file=sys.stderr, flush=True)
                return replace(base, yaml=source, source_yaml=source, world_size=world_size, parallel=layout), (note,)
    tried = " or ".join(f"{n} rank{'s' if n > 1 else ''}" for n in ranks)
    raise InputError(f"{recipe.path.name}: {why}; no YAML of it at {tried} gives a layout its code runs: pass "
                     f"--world-size N and --yaml FILE for one that registers the groups its code gets")


def write_copy(recipe: Recipe, plan: RunPlan) -> Path:
    """plan.yaml: plan.source_yaml on plan.checkpoint at plan.world_size ranks; on a tiny checkpoint
    (plan.max_new_tokens) lengths and batch cut too. The target's schema says where each key is."""
    data = load_yaml(plan.source_yaml) or {}
    schema = recipe.target.schema
    world_size = plan.world_size
    schema.set(data, "model_path", str(plan.checkpoint))
    if plan.parallel:
        data["parallel_config"] = dict(plan.parallel)          # the layout fit_layout chose
    elif isinstance(data.get("parallel_config"), dict):
        # scaled from the YAML's own rank count (the framework schema keeps world_size in parallel_config:
        # set first, a single-card YAML on N ranks would stay attn_tp / moe_tp 1)
        data["parallel_config"] = parallel_for(data["parallel_config"], world_size)
    schema.set(data, "world_size", world_size)
    if plan.max_new_tokens:
        schema.set(data, "input_len", TINY_INPUT_LEN)
        schema.set(data, "max_new_tokens", plan.max_new_tokens)
        if isinstance(data.get("scheduler_config"), dict):
            # the checkout's default prompt: a hub data set (LongBench) is neither here nor what parity uses
            schema.set(data, "dataset", "default")
            scheduler = data["scheduler_config"]
            # a whole number of requests per attention data-parallel rank (executor/offline/infer.py checks it)
            dp = max(1, world_size // int((data.get("parallel_config") or {}).get("attn_tp_size") or 1))
            batch = min(int(scheduler.get("batch_size") or 1), TINY_MAX_BATCH)
            scheduler["batch_size"] = -(-batch // dp) * dp
            if "max_prefill_tokens" in scheduler:
                scheduler["max_prefill_tokens"] = max(int(scheduler["max_prefill_tokens"]),
                                                      TINY_INPUT_LEN * scheduler["batch_size"])
    what = "a stand-in run (npu stand-in, not an NPU)" if plan.standin else "a run"
    header = (f"# {plan.source_yaml.name} for {what}, written by infer-migrator:\n"
              f"# model_path -> {plan.checkpoint}, {world_size} rank(s).\n")
    user_tree(recipe.path).write_text(plan.yaml, header + yamllib.safe_dump(data, sort_keys=False))
    return plan.yaml


def refresh(recipe: Recipe, plan: RunPlan) -> RunPlan:
    """Before a run: a plan's copy written again from the recipe's YAML (a repair edits that one),
    except a stand-in copy, which is what repairs of a stand-in run edit."""
    if plan.yaml != plan.source_yaml and plan.checkpoint is not None and not plan.standin \
            and plan.source_yaml is not None and plan.source_yaml.is_file():
        write_copy(recipe, plan)
    return plan


def old_schema_keys(recipe: Recipe, source: Path | None) -> list[str]:
    """A YAML's keys of the old, flat schema, which upstream's executor ignores silently, for a target
    that checks them: one evidence line each (agent.recipe.upstream_schema; the recipe's YAML, read
    again at every run, so a repaired one passes)."""
    if source is None or not Path(source).is_file():
        return []
    return recipe.target.ignored_yaml_keys(Path(source), recipe.repo_root, _shown(recipe, Path(source)))


def _shown(recipe: Recipe, path: Path) -> str:
    try:
        return path.relative_to(recipe.path).as_posix()
    except ValueError:
        return os.path.basename(path)
