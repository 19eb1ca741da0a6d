"""Before a native framework model runs: a layout the generated file runs right, and heads and widths that
split evenly at the YAML's tensor-parallel sizes (module.linear's layers divide them), or one line saying
what is wrong and which parallel_config keys to set, before anything runs (upstream's check_vars does the
same for its models). The generated file keeps the same rules as guards of its own (`check_parallel` in
the causal-LM part, agent/recipe/native/parts/code/causal_lm.py; `_moe_parallel` in parts/code/moe.py), for a YAML run
without this tool.

The layout rule: every collective of the generated file is over ranks that hold the same requests. Attention
data-parallel (attn_tp_size < world_size) gives each group of attn_tp_size ranks its own requests, and the file
gathers nothing across those groups, so
* the lm head's all-gather stays inside an attention group: lmhead_tp_size divides attn_tp_size;
* an MoE model's expert all-reduce spans moe_tp_group, and the MoE block has no expert parallel (upstream derives
  moe_ep_size = world_size // moe_tp_size): attn_tp_size == moe_tp_size == world_size."""

from __future__ import annotations

from pathlib import Path

from engine.safe_load import load_json


def is_native(recipe_path: Path) -> bool:
    """A framework recipe whose model is the native modeling_NAME.py (not the adapter around vendored code)."""
    name = recipe_path.name
    model = recipe_path / "models" / f"modeling_{name}.py"
    return not (recipe_path / "models" / f"modeling_{name}_framework.py").exists() and model.is_file() \
        and "def check_parallel(" in model.read_text(errors="replace")


def parallel_problem(config: dict, parallel: dict) -> str | None:
    """What the generated file would run wrong at parallel_config's sizes (layout_problem), else which head
    count or width does not divide at its attn_tp_size / lmhead_tp_size (an MoE model's expert widths: at
    moe_tp_size)."""
    config = config.get("text_config") or config
    layout = layout_problem(parallel, is_moe(config))
    if layout:
        return layout
    attn, lmhead, moe = (parallel.get(key, 1) for key in ("attn_tp_size", "lmhead_tp_size", "moe_tp_size"))
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    tp = "tensor-parallel size"
    checks = [("num_attention_heads", heads, attn, tp), ("intermediate_size", config.get("intermediate_size"), attn, tp),
              ("vocab_size", config.get("vocab_size"), lmhead, tp)]
    if is_moe(config):
        # the routed and shared experts' intermediate axis splits over moe_tp_size
        widths = ("moe_intermediate_size", "shared_expert_intermediate_size") if config.get("moe_intermediate_size") \
            else ("intermediate_size",)
        checks += [(key, config.get(key), moe, "moe_tp_size") for key in widths]
    if config.get("kv_lora_rank"):
        pass                 # MLA: one latent key / value head, whole on every rank; the query heads split
    elif isinstance(kv_heads, int) and kv_heads >= attn:
        checks.append(("num_key_value_heads", kv_heads, attn, tp))
    elif isinstance(kv_heads, int) and kv_heads and attn % kv_heads:
        checks.append(("attn_tp_size over num_key_value_heads (replicated)", attn, kv_heads, tp))
    for what, value, size, kind in checks:
        if isinstance(value, int) and size > 1 and value % size:
            return f"{what} {value} does not divide by parallel_config's {kind} {size}: choose a size that divides it"
    return None


def is_moe(config: dict) -> bool:
    """The native file of `config` (text level) has sparse-MoE layers."""
    from agent.recipe.native.parts.moe import EXPERT_COUNT_KEYS

    return any(isinstance(config.get(k), int) and config[k] > 1 for k in EXPERT_COUNT_KEYS)


def layout_problem(parallel: dict, moe: bool) -> str | None:
    """Why the generated file would run parallel_config's layout wrong (the module docs' rule), with the keys to
    set; None when it runs it. Sizes that do not divide world_size are upstream's ParallelConfig's refusal, said
    here before any rank starts."""
    sizes = {}
    for key in ("attn_tp_size", "moe_tp_size", "lmhead_tp_size", "world_size"):
        if key not in parallel:       # upstream's default (world_size: the largest size, as its launch runs it)
            continue
        value = parallel[key]
        if type(value) is not int or value < 1:      # a YAML string, float, bool or empty key: upstream fails on it
            return f"parallel_config's {key} {value!r} is not a whole number of ranks: set it to one (1 or more)"
        sizes[key] = value
    sizes = {key: sizes.get(key, 1) for key in ("attn_tp_size", "moe_tp_size", "lmhead_tp_size")} | \
        {"world_size": sizes.get("world_size")}
    world = sizes.pop("world_size") or max(sizes.values())
    for key, size in sizes.items():
        if world % size:
            return f"world_size {world} does not divide by {key} {size}: choose a size that divides it"
    attn, moe_tp, lmhead = sizes["attn_tp_size"], sizes["moe_tp_size"], sizes["lmhead_tp_size"]
    if moe and (moe_tp != world or attn != world):
        if moe_tp != world:
            why = (f"moe_tp_size {moe_tp} at world_size {world} is expert parallel (upstream derives moe_ep_size = "
                   f"world_size // moe_tp_size = {world // moe_tp}), which the generated MoE block does not run")
        else:
            why = (f"attn_tp_size {attn} with moe_tp_size {moe_tp} is attention data-parallel with MoE "
                   "tensor-parallel: the generated MoE block all-reduces over moe_tp_group, whose ranks would "
                   "hold different requests")
        keys = " and ".join(key for key in ("attn_tp_size", "moe_tp_size") if sizes[key] != world)
        return f"{why}; set {keys} to world_size ({world})"
    if attn % lmhead:
        return (f"lmhead_tp_size {lmhead} with attn_tp_size {attn}: the lm head's all-gather would join logits of "
                f"different requests (attention data-parallel, {world // attn} groups of {attn} rank(s)); set "
                f"lmhead_tp_size to attn_tp_size ({attn})")
    return None


def check(recipe_path: Path, checkpoint: Path | None, settings: dict, yaml_name: str) -> None:
    from agent.errors import InputError

    if checkpoint is None or not is_native(recipe_path):
        return
    parallel = settings.get("parallel_config") if isinstance(settings.get("parallel_config"), dict) else {}
    try:
        config = load_json(Path(checkpoint) / "config.json")
    except (OSError, ValueError):
        return
    problem = parallel_problem(config if isinstance(config, dict) else {}, parallel)
    if problem:
        raise InputError(f"{yaml_name}: {problem}")
