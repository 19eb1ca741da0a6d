"""A shrunk copy of a checkpoint's config: the same architecture and code paths, tiny dimensions.

The parity check runs the vendored code against transformers on this config with random weights, so
checking the code costs the same for a 0.6B and a 70B checkpoint. What decides which code runs is
kept: model_type, layer kinds (`layer_types` and other per-layer lists, cut to a prefix that still
holds every kind), tied embeddings, rope settings, vocabulary (the checkpoint's tokenizer is reused),
MoE / MLA structure. Sizes are only ever reduced.
"""

from __future__ import annotations

# Small dimensions, named the way most decoder configs name them. Keys a config class does not
# know are dropped (agent.testing.tiny_checkpoint.tiny_config), so one table serves every architecture.
TINY_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    # Partial rotary (gptj, codegen): their default 64 is wider than the tiny heads of 16.
    "rotary_dim": 8,
    "max_position_embeddings": 512,
    # Larger than the usual 0.02 so random logits are peaked: greedy tokens then do not hinge
    # on ties that float rounding could flip.
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    # MoE: few, small experts (defaults are 60+ experts, hundreds of MB).
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,     # kimi_linear's, bailing_hybrid's name of it (their attribute_map)
    "top_k_experts": 2,             # gemma4's name of it
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "num_expert_group": 1,          # kimi_linear's, bailing_hybrid's name of n_group (their attribute_map)
    "topk_group": 1,
    # MLA: small latent ranks.
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
}

# Kept from the checkpoint: they choose code paths or must match the tokenizer.
KEEP = {"max_position_embeddings", "tie_word_embeddings"}
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
# The GPT-2-era names of TINY_DIMS' widths, as config.json stores them (gpt2, gptj, codegen, ...).
ALIASES = {"n_embd": "hidden_size", "n_head": "num_attention_heads", "n_inner": "intermediate_size"}
# A state-space mixer's heads must tile its inner width, expand x hidden_size (each config class validates it):
# (heads key, head width key, expand key) as the Mamba-2 family names them.
SSM_HEADS = (("mamba_n_heads", "mamba_d_head", "mamba_expand"), ("num_heads", "head_dim", "expand"),
             ("mamba_num_heads", "mamba_head_dim", "expand"), ("n_mamba_heads", "mamba_headdim", "mamba_expand"))
SSM_TINY_HEADS = 4
INNER_KEY = "mamba_d_ssm"      # falcon_h1's inner width, where set: not expand x hidden_size
SSM_GROUP_KEYS = ("n_groups", "mamba_n_groups")
# Per-layer overrides keyed by layer index (gemma4's wider global heads, dots3's MLA layers): their widths
# shrink with the config's, their layers are layer kinds the cut keeps.
PER_LAYER_DICTS = ("per_layer_config",)
# the experts per token as a list per layer: each entry capped as num_experts_per_tok is
TOP_K_LISTS = ("moe_topk", "num_experts_per_tok")
PER_LAYER_WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
                    "num_key_value_heads")
# the query heads of each layer as a list (laguna's): shrunk with the key/value heads, each layer's grouping kept
PER_LAYER_HEAD_LISTS = ("num_attention_heads_per_layer",)
# one layer kind's key/value heads beside num_key_value_heads (gemma4's full layers: num_global_key_value_heads 2
# beside 8): shrunk in proportion, so that layers of unequal key heads stay unequal
KIND_KV_HEAD_KEYS = ("num_global_key_value_heads",)


def shrink_config(config: dict, cut_layers: bool = True) -> dict:
    """Overrides for `AutoConfig.from_pretrained(model_path, **overrides)` (text config level).
    `cut_layers=False`: widths only, every layer kept (for configs whose layer counts are tied
    together in ways a cut breaks, e.g. dory's input + recurrent + output sections)."""
    overrides: dict = {}
    for key, tiny in TINY_DIMS.items():
        if key in KEEP or key in LAYER_COUNT_KEYS or key not in config:   # layer counts: _layers
            continue
        value = config[key]
        if key == "initializer_range":
            overrides[key] = tiny   # peaked random logits: greedy tokens do not hinge on ties
        elif isinstance(value, int) and not isinstance(value, bool) and value > tiny:
            overrides[key] = tiny
    for alias, key in ALIASES.items():
        value = config.get(alias)
        # Only as a set with n_embd: heads cut under another width name break its head size (xlnet:
        # d_model, n_head and d_head must agree).
        if isinstance(value, int) and not isinstance(value, bool) and value > TINY_DIMS[key] \
                and isinstance(config.get("n_embd"), int):
            overrides[alias] = TINY_DIMS[key]
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and "num_attention_heads" in overrides:
        # Keep the attention kind: MHA stays MHA, MQA stays MQA, GQA stays grouped.
        overrides["num_key_value_heads"] = overrides["num_attention_heads"] if kv == heads else min(kv, 2)
    elif isinstance(heads, int) and kv == heads and "num_key_value_heads" in overrides:
        overrides.pop("num_key_value_heads")        # heads already tiny: MHA stays MHA (MLA's key heads are its heads)
    for key in KIND_KV_HEAD_KEYS:
        if key in config:
            overrides[key] = _fewer_kv_heads(config[key], config, overrides)
    falcon_kv = config.get("num_kv_heads")             # falcon's name of them
    if isinstance(heads, int) and isinstance(falcon_kv, int) and "num_attention_heads" in overrides:
        overrides["num_kv_heads"] = overrides["num_attention_heads"] if falcon_kv == heads else min(falcon_kv, 2)
    nk, nv = config.get("linear_num_key_heads"), config.get("linear_num_value_heads")
    if isinstance(nk, int) and isinstance(nv, int) and nk > 2 and nv % nk == 0:
        # linear attention's heads (qwen3_next's Gated DeltaNet): 2 key heads, the value heads' grouping kept; the
        # head widths are the kernels' (kept)
        overrides.update(linear_num_key_heads=2, linear_num_value_heads=2 * (nv // nk))
    if config.get("q_lora_rank") is None:
        overrides.pop("q_lora_rank", None)
    if "kv_lora_rank" in config:
        overrides.pop("head_dim", None)   # MLA derives head_dim from the rope / nope dims
        # a config.json that states the widths transformers derives (it saves them): derived from the shrunk ones
        rope = overrides.get("qk_rope_head_dim", config.get("qk_rope_head_dim"))
        if "qk_rope_head_dim" in overrides and config.get("head_dim") == config.get("qk_rope_head_dim"):
            overrides["head_dim"] = rope             # the rope table's width
        if isinstance(config.get("qk_head_dim"), int) and isinstance(rope, int):
            overrides["qk_head_dim"] = overrides.get("qk_nope_head_dim", config.get("qk_nope_head_dim", 0)) + rope
    overrides.update(ssm_heads({**config, **overrides}, overrides.get("hidden_size")))
    if cut_layers:
        overrides.update(_layers(config))
    for key in PER_LAYER_DICTS:
        if isinstance(config.get(key), dict):
            overrides[key] = _per_layer(config[key], overrides, config)
    for key in PER_LAYER_HEAD_LISTS:
        value = overrides.get(key, config.get(key))
        if isinstance(value, list):
            overrides[key] = _layer_heads(value, config, overrides)
    for key in TOP_K_LISTS:
        value = overrides.get(key, config.get(key))
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            # the experts per token per layer (hunyuan_v1_moe's moe_topk): no more than the few experts kept
            overrides[key] = [min(v, TINY_DIMS["num_experts_per_tok"]) for v in value]
    return overrides


def _fewer_kv_heads(value, config: dict, overrides: dict):
    """A layer kind's key/value heads `value` where they are fewer than the config's num_key_value_heads (gemma4's
    full layers, 2 of 8): in proportion to the shrunk num_key_value_heads, at least 1, so that they stay fewer;
    otherwise no more than the shrunk count (as any per-layer width)."""
    kv = config.get("num_key_value_heads")
    tiny = overrides.get("num_key_value_heads", kv)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (value, kv, tiny)):
        return value
    if value < kv:
        return max(1, tiny * value // kv)
    return min(value, tiny)


def _layer_heads(values: list, config: dict, overrides: dict) -> list:
    """Each layer's query heads for the shrunk key/value heads: as many per key/value head as the checkpoint's layer
    has (its grouping, so layers of unequal heads stay unequal); a count that is no multiple of them is kept."""
    kv, tiny = config.get("num_key_value_heads"), overrides.get("num_key_value_heads", config.get("num_key_value_heads"))
    if not (isinstance(kv, int) and isinstance(tiny, int) and kv > 0):
        return values
    return [tiny * (v // kv) if isinstance(v, int) and not isinstance(v, bool) and v % kv == 0 else v for v in values]


def ssm_heads(config: dict, hidden) -> dict:
    """A state-space mixer's head count (and, where it cannot tile, head width) for expand x `hidden`: the head
    width kept where it divides (a kernel's width), else SSM_TINY_HEADS heads."""
    for heads_key, width_key, expand_key in SSM_HEADS:
        heads, width, expand = config.get(heads_key), config.get(width_key), config.get(expand_key)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (hidden, heads, width, expand)):
            continue
        inner = expand * hidden
        # an inner width set apart from expand (falcon_h1's mamba_d_ssm): shrunk to expand x hidden with the heads
        inner_width = {INNER_KEY: inner} if isinstance(config.get(INNER_KEY), int) else {}
        if inner % width == 0:
            return {**_ssm_groups(config, {heads_key: inner // width}), **inner_width}
        tiny = min(heads, SSM_TINY_HEADS)
        return {**_ssm_groups(config, {heads_key: tiny, width_key: inner // tiny}), **inner_width}
    return {}


def _ssm_groups(config: dict, shrunk: dict) -> dict:
    """`shrunk` with the mixer's B / C group count (nemotron_h's n_groups 8) cut to divide its fewer heads: each
    group's heads share B and C, so the count must divide them (transformers repeats each group heads / groups
    times)."""
    import math

    heads = next(iter(shrunk.values()))
    for key in SSM_GROUP_KEYS:
        groups = config.get(key)
        if isinstance(groups, int) and not isinstance(groups, bool) and groups > 0 and heads % groups:
            shrunk[key] = math.gcd(heads, groups)
    return shrunk


def _per_layer(entries: dict, overrides: dict, config: dict) -> dict:
    """The per-layer overrides of the layers the cut keeps, their widths no larger than the shrunk config's."""
    kept = overrides.get(next((k for k in LAYER_COUNT_KEYS if k in overrides), ""), None)
    result = {}
    for index, values in entries.items():
        if kept is not None and int(index) >= kept:
            continue
        if isinstance(values, dict):
            values = {k: min(v, overrides.get(k, config.get(k, v)))
                      if k in PER_LAYER_WIDTHS and isinstance(v, int) and not isinstance(v, bool) else v
                      for k, v in values.items()}
            stored = entries[index]
            if "num_key_value_heads" in stored and stored["num_key_value_heads"] != stored.get(
                    "num_attention_heads", config.get("num_attention_heads")):      # grouped (MHA stays MHA above)
                values["num_key_value_heads"] = _fewer_kv_heads(stored["num_key_value_heads"], config, overrides)
        result[index] = values
    return result


# lists of the indices of the layers of one kind (bamba's attention layers among its Mamba2 ones; llama4's MoE layers,
# every layer's index where each is sparse: not a per-layer list, whose distinct values would keep every layer)
LAYER_INDEX_LISTS = ("attn_layer_indices", "moe_layers")


def _layers(config: dict) -> dict:
    key = next((k for k in LAYER_COUNT_KEYS if isinstance(config.get(k), int)), None)
    if key is None:
        return {}
    total = config[key]
    per_layer = {k: v for k, v in config.items() if isinstance(v, list) and len(v) == total and total > 1
                 and k not in LAYER_INDEX_LISTS}
    # A pattern of layer kinds shorter than the stack, repeated over it (recurrent_gemma's
    # block_types [recurrent, recurrent, attention]): kept whole, the prefix must hold each kind.
    patterns = [v for k, v in config.items() if isinstance(v, list) and 1 < len(v) < total
                and all(isinstance(x, str) for x in v) and len(set(v)) > 1]
    count = min(total, 2)
    for values in [*per_layer.values(), *patterns]:
        # A prefix that holds every kind of layer (e.g. sliding and full attention, Mamba and attention).
        first_seen = {}
        for i, v in enumerate(values):
            first_seen.setdefault(repr(v), i)
        count = max(count, max(first_seen.values()) + 1)
    for dict_key in PER_LAYER_DICTS:
        if isinstance(config.get(dict_key), dict) and config[dict_key]:
            # the first layer with its own overrides is a kind of layer the prefix must hold
            count = max(count, min(int(index) for index in config[dict_key]) + 1)
    for pattern_key in ("sliding_window_pattern", "full_attention_interval", "attn_layer_period"):
        if isinstance(config.get(pattern_key), int):
            count = max(count, config[pattern_key])
    # the indices of the layers of another kind (bamba's attn_layer_indices): the prefix holds the first
    indices = {k: config[k] for k in LAYER_INDEX_LISTS if isinstance(config.get(k), list) and config[k]}
    for values in indices.values():
        count = max(count, min(values) + 1)
    count = min(total, count)
    result = {key: count, **{k: [i for i in values if i < count] for k, values in indices.items()}}
    for k, values in per_layer.items():
        result[k] = values[:count]
    if isinstance(config.get("first_k_dense_replace"), int):
        dense_first = config["first_k_dense_replace"]
        # dense layers first, then at least one sparse one; a config whose every layer is dense stays so
        result["first_k_dense_replace"] = count if dense_first >= total else min(dense_first, 1, count - 1)
    return result
