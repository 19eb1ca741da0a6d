"""The npu stand-in's part in a run of a cann-recipes-infer recipe off an NPU (`migrator run RECIPE
--standin [--tiny]`): the tiny random checkpoint of the recipe's own architecture a `--tiny` plan runs
on (agent.run.plan), the stand-in's environment for the run, and the op without a reference kernel a
stand-in run stopped at (exit 4). The run's precision is checked as every run's is
(agent.measure.precision), on the plan's checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

from agent.errors import InputError, UnsupportedModelError
from agent.recipe.recipe import Recipe
from agent.recipe.targets import state_dir
from engine.safe_load import load_json
from agent.recipe.fs_guard import user_tree

RECORD_DIR = "standin"
# model_type of a recipe's config class that transformers lacks -> (the HF type with the same
# weights' shapes, its build overrides, config.json keys the recipe's class reads).
# Settings of the published checkpoints a recipe's code relies on that transformers' defaults lack:
# DeepSeek-V3/R1's config.json has YaRN rope scaling, which its modeling code reads (rope_scaling["factor"]);
# the tiny one scales 128 positions to its 512. Its attention keeps the KV caches in FRACTAL_NZ, 16-wide
# blocks (KV_CACHE_NZ_DIM = 16 in modeling_deepseek.py): the latent and rope widths are multiples of 16, and the
# rope width is the published 64, the one npu_interleave_rope takes (torch_npu documents D == 64). Its
# key heads are its query heads (num_key_value_heads = num_attention_heads, as the published config: MLA has
# one latent; transformers' eager attention repeats MLA's per-head keys by heads // num_key_value_heads).
TINY_SETTINGS = {
    "deepseek_v3": {"kv_lora_rank": 32, "qk_rope_head_dim": 64, "num_key_value_heads": 4, "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 128, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}},
}
# A tiny checkpoint is there to run the recipe's code paths: a sliding window longer than every prompt and
# its tokens leaves the window's code (the band at prefill, the window's blocks at decode) nothing to do,
# so a sliding-window type's tiny checkpoint has a window shorter than the default prompt.
TINY_SLIDING_WINDOW = 16
SHAPE_TWINS = {
    "PanguEmbedded": ("llama", {"attention_bias": True}, {"bias": True}),
}


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
            return tiny_checkpoint(model_type, out, **tiny_settings(model_type))
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


def quantize_tiny(recipe: Recipe, tiny: Path, scheme: str) -> Path:
    """`--standin --tiny --quantize w8a8`: the tiny checkpoint written W8A8 (agent.migrate.quantize) beside it,
    for a recipe's quantized YAML (upstream's models/qwen qwen3_8b_w8a8_*.yaml); built once."""
    from agent.migrate.quantize import plan, quantize_w8a8
    from agent.quantization_formats import is_w8a8

    out = tiny.with_name(f"{tiny.name}-{scheme}")
    plan(tiny)      # the run's verdict loads it with the installed transformers: what that cannot load, refused
    if (out / "config.json").is_file() and is_w8a8(load_json(out / "config.json")):
        return out
    tree = user_tree(recipe.path)
    tree.rmtree(out)
    quantize_w8a8(tiny, out, tree=tree)
    return out


def tiny_settings(model_type: str) -> dict:
    """The build overrides of `model_type`'s tiny checkpoint: TINY_SETTINGS, and TINY_SLIDING_WINDOW where
    transformers' default config has a longer window."""
    from transformers import CONFIG_MAPPING

    settings = dict(TINY_SETTINGS.get(model_type, {}))
    window = getattr(CONFIG_MAPPING[model_type](), "sliding_window", None)
    if isinstance(window, int) and window > TINY_SLIDING_WINDOW:
        settings.setdefault("sliding_window", TINY_SLIDING_WINDOW)
    return settings


# ---- running it --------------------------------------------------------------------------
def launch_env(device: str, env: dict, run_dir: Path) -> dict:
    """`env` for a stand-in run: the stand-in's variables and its records in the run folder (the
    precision probe is in every trial run: agent.run.trial_run)."""
    from npu_standin.environment import standin_env

    return standin_env(device, base=env, record_dir=run_dir / RECORD_DIR)


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
