"""Before a native framework model runs: a layout the generated file runs right, and heads and widths that
split evenly at the YAML's tensor-parallel sizes (module.linear's layers divide them), or one line saying
what is wrong and which parallel_config keys to set, before anything runs (upstream's check_vars does the
same for its models). The generated file keeps the same rules as guards of its own (`check_parallel` in
the causal-LM part, agent/recipe/native/parts/code/causal_lm.py; `MoeLayout` in parts/code/moe.py), for a YAML run
without this tool.

The layout rule: every collective of the generated file is over ranks that hold the same requests, or gathers
their rows first. Attention data-parallel (attn_tp_size < world_size) gives each group of attn_tp_size ranks its
own requests (upstream's infer.py: batch_size // attn_dp_size prompts each), so
* a group wider than the attention group (moe_tp_group, embed_tp_group, lmhead_tp_group) gathers the other groups'
  rows, computes on them all and gives each rank its own back (parts/code/parallel.py);
* the experts split over moe_ep_group (upstream derives moe_ep_size = world_size // moe_tp_size), tokens moving by
  all-to-all at prefill and MC2 dispatch / combine at decode, which route every rank's own tokens.
What does not run: sizes that do not divide world_size, a routed expert count moe_ep_size does not divide, and a
batch the attention data-parallel groups do not share evenly (upstream refuses the same, after its ranks start).

Switches (SWITCHES): a switch of upstream's models set in the YAML or the checkpoint's config (enable_mla_prolog,
next_n, moe_chunk_max_len, the int8 KV cache, prefill context parallel's cp_size) that the generated file does not
read, because the part that honours it is not in it, would be silently unused: refused here in one line naming the
key and what to do."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from agent.quantization_formats import kv_cache_scheme
from engine.safe_load import load_json


def model_file(recipe_path: Path) -> Path:
    """The framework recipe's modeling_NAME.py."""
    return recipe_path / "models" / f"modeling_{recipe_path.name}.py"


def is_native(recipe_path: Path) -> bool:
    """A framework recipe whose model is the native modeling_NAME.py (not the adapter around vendored code)."""
    name = recipe_path.name
    model = model_file(recipe_path)
    return not (recipe_path / "models" / f"modeling_{name}_framework.py").exists() and model.is_file() \
        and "def check_parallel(" in model.read_text(errors="replace")


def parallel_problem(config: dict, parallel: dict, batch_size: int | None = None) -> str | None:
    """What the generated file would run wrong at parallel_config's sizes (layout_problem), else which head
    count or width does not divide at its attn_tp_size / lmhead_tp_size (an MoE model's expert widths: at
    moe_tp_size)."""
    config = config.get("text_config") or config
    layout = layout_problem(parallel, is_moe(config), experts_of(config), batch_size)
    if layout:
        return layout
    attn, lmhead, moe = (parallel.get(key, 1) for key in ("attn_tp_size", "lmhead_tp_size", "moe_tp_size"))
    embed = parallel.get("embed_tp_size", 1)
    if config.get("linear_num_value_heads") and isinstance(attn, int) and attn > 1:
        # parts/code/linear_attention_gdn.py: the Gated DeltaNet layers are not split by head (upstream's qwen3_5 is)
        return (f"linear-attention layers (linear_num_value_heads) run whole on each rank in the generated file, not "
                f"at parallel_config's attn_tp_size {attn}: set attn_tp_size to 1")
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    tp = "tensor-parallel size"
    checks = [("num_attention_heads", heads, attn, tp), ("intermediate_size", config.get("intermediate_size"), attn, tp),
              ("vocab_size", config.get("vocab_size"), lmhead, tp), ("vocab_size", config.get("vocab_size"), embed, tp)]
    from agent.recipe.native.parts.attention_heads import listed_heads

    listed = listed_heads(config)
    if listed is not None:
        # each layer built with its own query heads (laguna; the global count builds none): every layer's splits
        checks = [(f"{listed[0]}[{index}]", count, attn, tp) for index, count in enumerate(listed[1])] + checks[1:]
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
    for what, count in layer_kind_key_heads(config):
        # a layer kind built with its own key/value heads (the fused attention's KV_HEADS_PER_LAYER): each splits too
        if count >= attn:
            checks.append((what, count, attn, tp))
        elif count and attn % count:
            checks.append((f"attn_tp_size over {what} (replicated)", attn, count, tp))
    for what, value, size, kind in checks:
        if isinstance(value, int) and size > 1 and value % size:
            return f"{what} {value} does not divide by parallel_config's {kind} {size}: choose a size that divides it"
    return None


def layer_kind_key_heads(config: dict) -> list[tuple[str, int]]:
    """(name, count) of the key/value heads a checkpoint's config.json gives some layers apart from
    num_key_value_heads: gemma4's full layers' num_global_key_value_heads (where attention_k_eq_v, as transformers
    applies it), or the per_layer_config entries' num_key_value_heads. MLA's are not (one latent head)."""
    if config.get("kv_lora_rank"):
        return []
    found = []
    if config.get("attention_k_eq_v") and isinstance(config.get("num_global_key_value_heads"), int):
        found.append(("num_global_key_value_heads", config["num_global_key_value_heads"]))
    for index, values in sorted((config.get("per_layer_config") or {}).items(), key=lambda item: int(item[0])):
        if isinstance(values, dict) and isinstance(values.get("num_key_value_heads"), int):
            found.append((f"per_layer_config[{int(index)}].num_key_value_heads", values["num_key_value_heads"]))
    return found


def experts_of(config: dict) -> int | None:
    """The routed expert count of `config` (text level), None for a dense model."""
    from agent.recipe.native.parts.moe import EXPERT_COUNT_KEYS

    return next((config[k] for k in EXPERT_COUNT_KEYS if isinstance(config.get(k), int) and config[k] > 1), None)


def expert_parallel_layout(config: dict, world_size: int) -> dict | None:
    """parallel_config upstream would write for a MoE model on `world_size` cards (models/qwen3_moe's 16ep /
    1tp_16ep YAMLs): attention and lm head tensor parallel over all of them, the experts expert parallel — moe_tp_size
    1 (moe_ep_size = world_size), or where the routed experts do not split that many ways the smallest moe_tp_size
    whose moe_ep_size divides them. None for a dense model or one card."""
    config = config.get("text_config") or config
    experts = experts_of(config)
    if experts is None or world_size < 2:
        return None
    moe_tp = next(m for m in range(1, world_size + 1) if world_size % m == 0 and experts % (world_size // m) == 0)
    return {"world_size": world_size, "attn_tp_size": world_size, "moe_tp_size": moe_tp, "embed_tp_size": 1,
            "lmhead_tp_size": world_size}


def expert_layout_of(checkpoint: Path, world_size: int) -> dict | None:
    """{"parallel_config": expert_parallel_layout, "how": its words} for the MoE model whose config.json is in
    `checkpoint` on `world_size` cards; None for a dense model, one card, or no readable config."""
    try:
        config = load_json(Path(checkpoint) / "config.json")
    except (OSError, ValueError):
        return None
    layout = expert_parallel_layout(config, world_size) if isinstance(config, dict) else None
    if layout is None:
        return None
    return {"parallel_config": layout,
            "how": describe_expert_layout(layout, experts_of(config.get("text_config") or config))}


def describe_expert_layout(layout: dict, experts: int) -> str:
    """The layout in words, as the report names it: 'attention tensor parallel over 4, experts expert parallel over 4
    (moe_tp_size 1, moe_ep_size 4: 2 of 8 routed experts a rank)'."""
    world, moe_tp = layout["world_size"], layout["moe_tp_size"]
    ep = world // moe_tp
    return (f"attention tensor parallel over {layout['attn_tp_size']}, experts expert parallel over {ep} (moe_tp_size "
            f"{moe_tp}, moe_ep_size {ep}: {experts // ep} of {experts} routed experts a rank)")


def is_moe(config: dict) -> bool:
    """The native file of `config` (text level) has sparse-MoE layers."""
    from agent.recipe.native.parts.moe import EXPERT_COUNT_KEYS

    return any(isinstance(config.get(k), int) and config[k] > 1 for k in EXPERT_COUNT_KEYS)


def layout_problem(parallel: dict, moe: bool, experts: int | None = None, batch_size: int | None = None) -> str | None:
    """Why the generated file would not run parallel_config's layout (the module docs' rule), with the keys to
    set; None when it runs it. `experts`: the routed expert count of an MoE model; `batch_size`: the YAML's
    scheduler_config.batch_size. Sizes that do not divide world_size are upstream's ParallelConfig's refusal,
    said here before any rank starts."""
    keys = ("attn_tp_size", "moe_tp_size", "embed_tp_size", "lmhead_tp_size", "cp_size")
    sizes = {}
    for key in (*keys, "world_size"):
        if key not in parallel:       # upstream's default (world_size: the largest size, as its launch runs it)
            continue
        value = parallel[key]
        if type(value) is not int or value < 1:      # a YAML string, float, bool or empty key: upstream fails on it
            return f"parallel_config's {key} {value!r} is not a whole number of ranks: set it to one (1 or more)"
        sizes[key] = value
    sizes = {key: sizes.get(key, 1) for key in keys} | {"world_size": sizes.get("world_size")}
    world = sizes.pop("world_size") or max(sizes.values())
    for key, size in sizes.items():
        if world % size:
            return f"world_size {world} does not divide by {key} {size}: choose a size that divides it"
    attn, moe_tp, cp = sizes["attn_tp_size"], sizes["moe_tp_size"], sizes.pop("cp_size")
    if cp > 1 and (cp != world or attn != 1):
        # upstream's ParallelConfig refuses the same once its ranks start ("Phase1 prefill CP")
        return (f"cp_size {cp} with world_size {world} and attn_tp_size {attn}: upstream's prefill context parallel "
                f"needs cp_size equal to world_size and attn_tp_size 1; set cp_size {world} and attn_tp_size 1, or "
                "cp_size 1")
    ep = world // moe_tp
    if moe and experts and experts % ep:
        fits = [m for m in range(1, world + 1) if world % m == 0 and experts % (world // m) == 0]
        return (f"{experts} routed experts do not split over moe_ep_size {ep} (upstream derives world_size {world} // "
                f"moe_tp_size {moe_tp}); set moe_tp_size to {fits[0]} (moe_ep_size {world // fits[0]})")
    dp = world // attn
    if dp > 1 and type(batch_size) is int and batch_size % dp:
        return (f"scheduler_config's batch_size {batch_size} does not split over {dp} attention data-parallel groups "
                f"(world_size {world} // attn_tp_size {attn}); set batch_size to a multiple of {dp}")
    return None


@dataclass(frozen=True)
class Switch:
    """A switch of upstream's models that only a part of the native generator honours: set where the generated
    file does not read it, it would be silently unused, so it is refused. `where`: "yaml" (the run's YAML) or
    "config" (the checkpoint's config.json); `path`: its keys from there; `is_set(value)`: the value asks for the
    feature; `reads`: the name the generated file reads it by (present only where the part is); `part`: which part
    honours it, in words; `fix`: what to do; `needs`: another YAML key the generated file (as upstream's model)
    also requires on before it uses the switch, `needs_default` its value when the YAML leaves it out (upstream's
    InferenceConfig default); `read`: where a reader of the key's format exists (agent.quantization_formats), the
    value from config.json by it (`path` then names the key for the user)."""

    where: str
    path: tuple[str, ...]
    is_set: Callable[[object], bool]
    reads: str
    part: str
    fix: str
    needs: tuple[str, ...] = ()
    needs_default: object = None
    read: Callable[[dict], object] | None = None


def _on(value) -> bool:
    return value not in (None, False, 0, "", "unquant")


# switch -> the part of the generator that must be in the generated file for it to do anything
SWITCHES = (
    Switch("yaml", ("model_config", "custom_params", "enable_mla_prolog"), _on, "enable_mla_prolog",
           "an MLA attention whose query is q LoRA without biases (parts/mla.py: npu_mla_prolog_v3)",
           "remove it or set it to false", needs=("model_config", "enable_weight_nz"),
           needs_default=True),
    Switch("yaml", ("model_config", "next_n"), _on, "next_n",
           "an MTP draft (parts/mtp.py: a DeepSeek-V3 / GLM-4.5 checkpoint whose num_nextn_predict_layers layer "
           "ships in its tensors)", "set next_n to 0 or remove it"),
    Switch("yaml", ("model_config", "custom_params", "moe_chunk_max_len"), lambda value: value is not None,
           "moe_chunk_max_len", "sparse-MoE layers (parts/moe.py)", "remove it"),
    # upstream's C8 (models/deepseek_r1: quant_config.kv_cache_quant_mode "int8", from compressed-tensors'
    # kv_cache_scheme) quantizes MLA's latent cache with one per-layer ckv_scale. Its decode step is
    # npu_mla_prolog_v3 kv_cache_quant_mode 1, which op-plugin documents only with int8 weights and activations
    # (weight_quant_mode 2, query_quant_mode 1: an int8 query with per-token-head scales), feeding
    # npu_fused_infer_attention_score_v2's full-quant MLA form (int8 query / cache, bf16 rope, query_quant_mode 3,
    # dequant_scale_query / _key / _value): op-plugin's and CANN's pages give its parameters but no formula (how
    # the bf16 rope scores meet the dequantized int8 ones, how P meets the int8 value) and no golden test, so the
    # stand-in cannot compute it without guessing (docs/quantization.md, "MLA's int8 KV cache")
    Switch("config", ("quantization_config", "kv_cache_scheme"), _on, "kv_cache_quant_mode",
           "an attention part with a quantized KV cache (none yet: the MLA part's int8 cache, upstream's C8, runs "
           "npu_mla_prolog_v3 kv_cache_quant_mode 1, documented only with W8A8 weights and an int8 query, into "
           "npu_fused_infer_attention_score_v2's full-quant MLA form, query_quant_mode 3, whose arithmetic no "
           "op-plugin or CANN page gives, so the NPU stand-in does not compute it)",
           "use the checkpoint without its kv_cache_scheme (a float KV cache)", read=kv_cache_scheme),
    # upstream's prefill context parallel: the executor hands every CP rank the whole padded batch and describes
    # each rank's zigzag segments in forward_metadata.cp_metadata; a file that does not read it attends over the
    # wrong tokens and writes other ranks' requests into its cache. The dense fused attention reads it
    # (parts/code/context_parallel.py); MLA, soft-capped attention and models with sparse-MoE layers do not
    Switch("yaml", ("parallel_config", "cp_size"), lambda value: value not in (None, 1), "cp_metadata",
           "the fused attention of a dense model, which attends its context-parallel segments over the keys and "
           "values gathered across the CP ranks (parts/code/context_parallel.py; not MLA, soft-capped attention or "
           "sparse-MoE layers)", "remove it or set cp_size to 1"),
)


def _value(settings: dict, path: tuple[str, ...], default=None):
    for key in path:
        if not isinstance(settings, dict) or key not in settings:
            return default
        settings = settings[key]
    return settings


def names_read(model_source: str) -> set[str]:
    """The names a generated file reads switches by: its string constants (docstrings aside) and attribute names."""
    tree = ast.parse(model_source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names.add(node.value)
    return names


def switch_problem(settings: dict, config: dict, model_source: str, model_name: str = "the model") -> str | None:
    """The first switch of SWITCHES set in the run's YAML (`settings`) or the checkpoint's config.json (`config`)
    that the generated file (`model_source`) does not read, in one line with what to do; None when every switch
    set is honoured (or a model file that does not parse: the run says why itself)."""
    try:
        read = names_read(model_source)
    except SyntaxError:
        return None
    for switch in SWITCHES:
        value = switch.read(config) if switch.read is not None else \
            _value(settings if switch.where == "yaml" else config, switch.path)
        if not switch.is_set(value):
            continue
        key = ".".join(switch.path) if switch.where == "yaml" else f"config.json's {'.'.join(switch.path)}"
        if switch.reads not in read:
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            return (f"{key} is set ({shown}) but {model_name}'s generated file has no part that honours it (it "
                    f"needs {switch.part}): {switch.fix}")
        if switch.needs and not _on(_value(settings, switch.needs, switch.needs_default)):
            needed = ".".join(switch.needs)
            return (f"{key} is set but {needed} is not, and {model_name}'s generated file (as upstream's model) uses "
                    f"{switch.reads} only with it: set {needed}: true too, or {switch.fix}")
    return None


def check(recipe_path: Path, checkpoint: Path | None, settings: dict, yaml_name: str) -> None:
    """The run's YAML (`settings`) against the generated native file and the checkpoint, before any rank starts:
    layouts and sizes (parallel_problem), then switches the file would leave unused (switch_problem)."""
    from agent.errors import InputError

    if checkpoint is None or not is_native(recipe_path):
        return
    parallel = settings.get("parallel_config") if isinstance(settings.get("parallel_config"), dict) else {}
    try:
        config = load_json(Path(checkpoint) / "config.json")
    except (OSError, ValueError):
        return
    config = config if isinstance(config, dict) else {}
    scheduler = settings.get("scheduler_config") if isinstance(settings.get("scheduler_config"), dict) else {}
    problem = parallel_problem(config, parallel, scheduler.get("batch_size")) or switch_problem(
        settings, config, model_file(recipe_path).read_text(errors="replace"), recipe_path.name)
    if problem:
        raise InputError(f"{yaml_name}: {problem}")
