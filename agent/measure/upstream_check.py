"""cann-recipes-infer's own recipes validated off an NPU: `migrator run RECIPE --standin [--tiny]`.

A framework model (`models/M` run by the checkout's `executor/scripts/infer.sh --model M --yaml F`) or
a legacy recipe (its own `infer.sh`) runs under the npu stand-in (npu_standin: npu on the host device,
torch_npu kernels as reference implementations). What this module adds to the workflow:

* `plan(recipe, ...)`: which YAML runs and on which weights. With the YAML's `model_path` present here
  the recipe runs on them; absent (the usual case: weights live on the NPU host), `--tiny` builds a
  random checkpoint of the recipe's own architecture in a shrunk shape (the config class's
  `model_type`) and runs a *copy* of the YAML pointed at it (in our state folder,
  `res/.migrator/standin/config/`, which upstream's .gitignore keeps out of `git status`), lengths
  cut; upstream's files are not touched. The plan is JSON data in the workflow state.
* `launch_env(plan, run_dir)` / `legacy_command(...)`: the stand-in's environment, and for a legacy
  recipe whose infer.sh names its YAML itself, its own script text with only that name pointed at the copy.
* `unsupported(run)`: the op without a reference kernel a stand-in run stopped at (exit 4).
The run's precision is checked as every run's is (agent.measure.precision), on the plan's checkpoint.
"""

from __future__ import annotations


import json
import os
import re
import sys
from pathlib import Path

import yaml as yamllib

from agent.recipe.targets import state_dir
from agent.errors import EnvironmentProblem, InputError, UnsupportedModelError
from agent.recipe.recipe import Recipe, read_settings
from agent.recipe.model_type import recipe_model_type
from engine.safe_load import load_json, load_yaml
from agent.recipe.fs_guard import user_tree

STANDIN_DIR = ".standin"                 # config/.standin/: where earlier releases put the YAML copies
RECORD_DIR = "standin"
TINY_INPUT_LEN = 128
TINY_MAX_BATCH = 4
# model_type of a recipe's config class that transformers lacks -> (the HF type with the same
# weights' shapes, its build overrides, config.json keys the recipe's class reads).
# Settings of the published checkpoints a recipe's code relies on that transformers' defaults lack:
# DeepSeek-V3/R1's config.json has YaRN rope scaling, which its modeling code reads (rope_scaling["factor"]);
# the tiny one scales 128 positions to its 512. Its attention keeps the KV caches in FRACTAL_NZ, 16-wide
# blocks (KV_CACHE_NZ_DIM = 16 in modeling_deepseek.py): the latent and rope widths are multiples of 16.
TINY_SETTINGS = {
    "deepseek_v3": {"kv_lora_rank": 32, "qk_rope_head_dim": 16, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 128, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
}
SHAPE_TWINS = {
    "PanguEmbedded": ("llama", {"attention_bias": True}, {"bias": True}),
}


def plan(recipe: Recipe, *, yaml_name: str | None = None, world_size: int = 1, tiny: bool = False,
         max_new_tokens: int = 16, device: str = "cpu") -> dict:
    """What a `--standin` run of `recipe` runs (see the module docs); InputError (exit 2) for a YAML
    that is not there or weights that are absent without --tiny, EnvironmentProblem (exit 4) where
    the stand-in must not run (a working NPU is here)."""
    from npu_standin.launcher import StandinRefused, check_can_run

    if recipe.kind not in ("framework", "legacy"):
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
    source = _source_yaml(recipe, yaml_name, world_size)
    settings = read_settings(source)
    section = settings["model_config"] if _framework_schema(settings) else settings
    model_path = recipe.resolve(section.get("model_path"))
    ranks = _world_size(settings)
    result = {"device": device, "source_yaml": str(source), "yaml": str(source), "world_size": world_size,
              "checkpoint": str(model_path) if model_path else None, "tiny": False, "notes": [],
              "max_new_tokens": _max_new_tokens(settings), "input_len": _input_len(settings)}
    if model_path is not None and (model_path / "config.json").is_file() and ranks == world_size:
        result["notes"].append(f"weights: {model_path} (the YAML's model_path)")
        return result
    if model_path is not None and (model_path / "config.json").is_file():
        checkpoint, how = model_path, f"weights: {model_path} (the YAML's model_path)"
    elif not tiny:
        old = [line for line in old_schema_keys(recipe, result) if "'model_path'" in line]
        raise InputError(f"{source.name}: " + (old[0] if old else
                         f"model_path {section.get('model_path')!r} is not here (the weights live on "
                         "the NPU host); pass --tiny to run the recipe on a tiny random checkpoint of its own "
                         "architecture, or point model_path at local weights"))
    else:
        model_type = recipe_model_type(recipe, settings)
        print(f"[migrator] --tiny: a tiny random {model_type} checkpoint in {state_dir(recipe.path) / 'standin'} "
              f"({section.get('model_path')!r} is not here)", file=sys.stderr, flush=True)
        checkpoint = build_tiny(recipe, model_type)
        how = (f"weights: tiny random {model_type} checkpoint {checkpoint} (the YAML's model_path "
               f"{section.get('model_path')!r} is not here)")
        result.update(tiny=True, model_type=model_type)
    copy = write_yaml_copy(recipe, source, checkpoint, world_size, max_new_tokens if result["tiny"] else None)
    copied = read_settings(copy)
    result.update(yaml=str(copy), checkpoint=str(checkpoint), max_new_tokens=_max_new_tokens(copied),
                  input_len=_input_len(copied))
    result["notes"] += [how, f"ran a copy of {source.name}: {copy.relative_to(recipe.path)} (upstream's files "
                             "untouched)"]
    dataset = (settings.get("data_config") or {}).get("dataset", "default")
    if result["tiny"] and dataset != "default":
        result["notes"].append(f"dataset {dataset!r} -> 'default' (the checkout's default prompt) in the copy")
    return result


def old_schema_keys(recipe: Recipe, plan: dict) -> list[str]:
    """A framework YAML's keys of the old, flat schema, which the executor ignores silently: one
    evidence line each (agent.recipe.upstream_schema; the source YAML, read again at every run, so a
    repaired one passes)."""
    from agent.recipe.upstream_schema import check

    source = Path(plan.get("source_yaml") or "")
    if recipe.kind != "framework" or not source.is_file():
        return []
    try:
        shown = source.relative_to(recipe.path).as_posix()
    except ValueError:
        shown = source.name
    return check(source, recipe.repo_root, shown)


def _framework_schema(settings: dict) -> bool:
    """The framework's four-section YAML (model_config.model_name); a legacy YAML is flat, though it
    may have a model_config of quantization and mode switches."""
    return isinstance(settings.get("model_config"), dict) and "model_name" in settings["model_config"]


def _world_size(settings: dict) -> int:
    parallel = settings.get("parallel_config") if isinstance(settings.get("parallel_config"), dict) else {}
    try:
        return int(parallel.get("world_size", settings.get("world_size", 1)))
    except (TypeError, ValueError):
        return 1


def _max_new_tokens(settings: dict) -> int:
    scheduler = settings.get("scheduler_config") or {}
    data = settings.get("data_config") or {}
    return int(scheduler.get("max_new_tokens") or data.get("max_new_tokens") or 32)


def _input_len(settings: dict) -> int:
    data = settings.get("data_config") or {}
    return int(data.get("input_truncated_len") or data.get("input_max_len") or 1024)


def _source_yaml(recipe: Recipe, yaml_name: str | None, world_size: int) -> Path:
    config = recipe.path / "config"
    available = sorted(p.relative_to(config).as_posix() for p in config.rglob("*.y*ml")
                       if p.is_file() and STANDIN_DIR not in p.relative_to(config).parts) if config.is_dir() else []
    if yaml_name:
        path = (config / yaml_name).resolve()
        if not path.is_file() or config.resolve() not in path.parents:
            raise InputError(f"--yaml {yaml_name}: no such file in {config} (there: {', '.join(available) or 'none'})")
        return path
    if recipe.yaml is None:
        raise InputError(f"{config} has no YAML file")
    if world_size == _world_size(read_settings(recipe.yaml)):
        return recipe.yaml
    for name in available:
        if _world_size(read_settings(config / name)) == world_size:
            return config / name
    return recipe.yaml        # its copy is set to world_size ranks (write_yaml_copy)


def build_tiny(recipe: Recipe, model_type: str) -> Path:
    """A tiny random checkpoint of `model_type` in the recipe's .migrator/standin/ (built once):
    transformers' shapes, a byte-level BPE tokenizer, a ChatML template (upstream's scheduler applies
    one to every prompt). A type transformers lacks is built as its shape twin (SHAPE_TWINS) and
    relabelled with the recipe's model_type."""
    from transformers import CONFIG_MAPPING

    from agent.measure.reference import tiny_checkpoint

    out = state_dir(recipe.path) / "standin" / f"tiny_{model_type}"   # beside our state: git-ignored in a checkout
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    twin = SHAPE_TWINS.get(model_type)
    if model_type not in CONFIG_MAPPING and twin is None:
        raise InputError(f"--tiny: transformers has no {model_type!r} architecture to build a checkpoint from; "
                         "point the YAML's model_path at local weights")
    tree = user_tree(recipe.path)
    tree.mkdir(out)            # refused before anything is built when .migrator/ or res/ leads out of the recipe
    if twin is None:
        try:
            return tiny_checkpoint(model_type, out, **TINY_SETTINGS.get(model_type, {}))
        except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
            raise UnsupportedModelError(f"--tiny: transformers cannot build a {model_type} causal LM to make a "
                                        f"checkpoint from ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); "
                                        "point the YAML's model_path at local weights") from None
    base, overrides, keys = twin
    tiny_checkpoint(base, out, **overrides)
    config = load_json((out / "config.json"))
    config.update(model_type=model_type, architectures=[f"{model_type}ForCausalLM"], **keys)
    tree.write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    return out


TP_KEYS = ("attn_tp_size", "moe_tp_size", "lmhead_tp_size")


def _parallel_for(parallel: dict, world_size: int) -> dict:
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


def yaml_copy_dir(recipe: Recipe) -> Path:
    """Where a stand-in run's YAML copies go: our state folder (agent.recipe.targets.state_dir;
    `res/.migrator/` in a checkout, git-ignored by upstream's `**/res/**`), not the recipe's config/."""
    return state_dir(recipe.path) / "standin" / "config"


def write_yaml_copy(recipe: Recipe, source: Path, checkpoint: Path, world_size: int,
                    max_new_tokens: int | None) -> Path:
    """yaml_copy_dir()/<name>: `source` on `checkpoint` at `world_size` ranks; with `max_new_tokens`
    (a tiny checkpoint) lengths and batch cut too. Both YAML schemas (framework four sections, legacy flat)."""
    data = load_yaml(source) or {}
    framework = _framework_schema(data)
    section = data["model_config"] if framework else data
    section["model_path"] = str(checkpoint)
    if framework:
        data["parallel_config"] = _parallel_for(data.get("parallel_config") or {}, world_size)
        if max_new_tokens:
            data.setdefault("data_config", {})["input_truncated_len"] = TINY_INPUT_LEN
            # the checkout's default prompt: a hub data set (LongBench) is neither here nor what parity uses
            data["data_config"]["dataset"] = "default"
            scheduler = data.setdefault("scheduler_config", {})
            scheduler["max_new_tokens"] = max_new_tokens
            # a whole number of requests per attention data-parallel rank (executor/offline/infer.py checks it)
            dp = max(1, world_size // int(data["parallel_config"].get("attn_tp_size") or 1))
            batch = min(int(scheduler.get("batch_size") or 1), TINY_MAX_BATCH)
            scheduler["batch_size"] = -(-batch // dp) * dp
            for key in ("max_prefill_tokens",):
                if key in scheduler:
                    scheduler[key] = max(int(scheduler[key]), TINY_INPUT_LEN * scheduler["batch_size"])
    else:
        data["world_size"] = world_size
        if isinstance(data.get("parallel_config"), dict):
            data["parallel_config"] = _parallel_for(data["parallel_config"], world_size)
        if max_new_tokens:
            data.setdefault("data_config", {}).update(input_max_len=TINY_INPUT_LEN, max_new_tokens=max_new_tokens)
    target = yaml_copy_dir(recipe) / source.name
    header = (f"# {source.name} for a stand-in run (npu stand-in, not an NPU), written by infer-migrator:\n"
              f"# model_path -> {checkpoint}, {world_size} rank(s).\n")
    user_tree(recipe.path).write_text(target, header + yamllib.safe_dump(data, sort_keys=False))

    return target


# ---- running it --------------------------------------------------------------------------
def launch_env(plan: dict, env: dict, run_dir: Path) -> dict:
    """`env` for a stand-in run: the stand-in's variables and its records in the run folder (the
    precision probe is in every trial run: agent.run.trial_run)."""
    from npu_standin.environment import standin_env

    return standin_env(plan.get("device", "cpu"), base=env, record_dir=run_dir / RECORD_DIR)


# the value: a quoted word (which may be "${YAML_FILE_NAME:-default.yaml}") or a bare one, ending in .yaml
_LEGACY_YAML_RE = re.compile(r"""^(\s*(?:export\s+)?(?:YAML_FILE_NAME|YAML_FILE)=)"""
                             r"""("[^"\n]*\.ya?ml\}?"|'[^'\n]*\.ya?ml\}?'|[^"'\s#]+\.ya?ml)""", re.M)


def legacy_command(recipe: Recipe, plan: dict) -> tuple[str, ...] | None:
    """A legacy recipe whose infer.sh names its YAML itself, run on the copy: its own script text
    (`bash -c`, in the recipe folder, so its paths resolve as they do) with only that name changed.
    None when no change is needed (the plan runs the recipe's own YAML)."""
    if recipe.kind != "legacy" or plan["yaml"] == plan["source_yaml"]:
        return None
    text = (recipe.path / "infer.sh").read_text(encoding="utf-8", errors="replace")
    rel = Path(os.path.relpath(plan["yaml"], recipe.path / "config")).as_posix()
    changed, n = _LEGACY_YAML_RE.subn(lambda m: f'{m.group(1)}"{rel}"', text)
    if n == 0:
        raise InputError(f"{recipe.path / 'infer.sh'}: no YAML_FILE_NAME= line to point at {rel}")
    return ("bash", "-c", changed, str(recipe.path / "infer.sh"))


def usage(run_dir: Path) -> dict | None:
    from npu_standin.record import read_op_usage

    return read_op_usage(Path(run_dir) / RECORD_DIR)


_CAPTURED_UNSUPPORTED = re.compile(r"npu stand-in: (?P<name>[\w.]+) has no reference kernel "
                                   r"\(called at (?P<site>a captured region \(torch\.compile\))\)")


def unsupported(run_dir: Path, evidence: str = "", roots: list[Path] | None = None) -> str | None:
    """"OP has no reference kernel in the npu stand-in (first call at FILE:LINE)" for the first op the
    run called that the stand-in cannot run, or the compiled custom op it stopped at (from the run's
    `evidence`, located inside `roots`); None when there is none."""
    from agent.recipe.compiled_ops import from_evidence

    found = usage(run_dir) or {}
    calls = found.get("unsupported") or []
    if not calls and evidence and (line := _CAPTURED_UNSUPPORTED.search(evidence)):
        # raised while dynamo traced a captured region (no record there: npu_standin.errors): the line itself
        return f"{line['name']} has no reference kernel in the npu stand-in (called in {line['site']})"
    if not calls:
        op = from_evidence(evidence, roots or []) if evidence else None
        return f"compiled custom op {op.line()}: the npu stand-in cannot run it" if op else None
    names = list(dict.fromkeys(c["name"] for c in calls))
    return (f"{names[0]} has no reference kernel in the npu stand-in (first call at "
            f"{_relative_site(calls[0]['site'], roots or [])})"
            + (f"; also: {', '.join(names[1:5])}" if len(names) > 1 else ""))


def _relative_site(site: str, roots: list[Path]) -> str:
    """FILE:LINE with FILE relative to the first of `roots` holding it (the checkout), else as given."""
    file, sep, line = str(site).rpartition(":")
    for root in roots:
        try:
            return f"{Path(file).resolve().relative_to(Path(root).resolve()).as_posix()}{sep}{line}"
        except (ValueError, OSError):
            continue
    return str(site)
