"""Query heads per layer (laguna's config.num_attention_heads_per_layer): each layer's attention built with its own
query head count, its key/value heads (and so its paged cache) the config's. Read from the layers, not from a
per-model table: a config key holding one positive int per layer is the layers' query heads where every attention
layer's q_proj is that many heads wide, on the checkpoint's config and on a variant with the key's odd layers given
one more group of heads (the file's self-check then runs that variant too). The fused attention part writes it as
the option HEADS_PER_LAYER (the key); the generated check_parallel and preflight split each layer's count at the
attention's tensor-parallel size."""

from __future__ import annotations

# config keys that may hold each layer's query heads (preflight reads them from a checkpoint's config.json, where
# no probe runs)
HEADS_PER_LAYER_KEYS = ("num_attention_heads_per_layer",)


def _listed(config, key: str, layers: int) -> list | None:
    value = getattr(config, key, None)
    if isinstance(value, list) and len(value) == layers and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        return value
    return None


def _query_heads(probe) -> dict[int, int | None]:
    """Each attention layer's query heads as its q_proj's width holds them; None where it has no separate q_proj."""
    import torch

    from agent.recipe.native.parts.probe import children

    found = {}
    for index, layer in enumerate(probe.layers):
        if not hasattr(layer, "self_attn"):
            continue                    # a hybrid's linear-attention layer
        q_proj = children(layer.self_attn).get("q_proj")
        width = q_proj.out_features if isinstance(q_proj, torch.nn.Linear) else None
        found[index] = width // probe.head_dim if width and width % probe.head_dim == 0 else None
    return found


def _follows(probe, values: list) -> bool:
    heads = _query_heads(probe)
    # exactly: a list at half the heads (hunyuan_v1_moe's moe_topk [2, 2] beside 4 heads) is no count of them
    return bool(heads) and all(got == values[index] for index, got in heads.items())


def heads_per_layer(probe) -> tuple[str, dict] | None:
    """(the config key of each layer's query heads, the config change that varies them per layer), or None for a
    model whose layers all take config.num_attention_heads. Memoised on the probe."""
    if "heads_per_layer" in probe.memo:
        return probe.memo["heads_per_layer"]
    found = None
    layers = probe.config.num_hidden_layers
    for key in sorted(probe.config.to_dict()):
        values = _listed(probe.config, key, layers)
        if values is None or not _follows(probe, values):
            continue
        # one more group of heads on the odd layers: their q_proj widths follow where the key sets the heads
        step = probe.kv_heads if all(v % probe.kv_heads == 0 for v in values) else 1
        varied = [v + step if index % 2 else v for index, v in enumerate(values)]
        try:
            other = probe.variant({key: varied})
        except Exception:  # noqa: BLE001 - a config the architecture refuses: the key not confirmed
            continue
        if _listed(other.config, key, layers) == varied and _follows(other, varied):
            found = (key, {key: varied})
            break
    probe.memo["heads_per_layer"] = found
    return found


def layer_heads(probe, index: int) -> int:
    """Layer `index`'s query heads: the config's per-layer key's, else num_attention_heads."""
    found = heads_per_layer(probe)
    return getattr(probe.config, found[0])[index] if found else probe.heads


def listed_heads(config: dict) -> tuple[str, list] | None:
    """(key, values) of a checkpoint config.json's per-layer query heads (HEADS_PER_LAYER_KEYS), or None."""
    for key in HEADS_PER_LAYER_KEYS:
        value = config.get(key)
        if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return key, value
    return None


def _key_heads(probe) -> dict[int, int | None]:
    """Each attention layer's key/value heads as its k_proj's width holds them; None where it has no separate
    k_proj."""
    import torch

    from agent.recipe.native.parts.probe import children

    found = {}
    for index, layer in enumerate(probe.layers):
        if not hasattr(layer, "self_attn"):
            continue
        k_proj = children(layer.self_attn).get("k_proj")
        width = k_proj.out_features if isinstance(k_proj, torch.nn.Linear) else None
        found[index] = width // probe.head_dim if width and width % probe.head_dim == 0 else None
    return found


def _kind_multiples(probe) -> tuple | None:
    """((layer kind, multiple), ...) of the kinds whose layers' k_proj hold a multiple other than 1 of
    num_key_value_heads, the same for every layer of the kind; () where all hold it once; None for another
    pattern."""
    kinds = getattr(probe.config, "layer_types", None)
    if not isinstance(kinds, list) or len(kinds) < len(probe.layers) or not probe.kv_heads:
        return None
    multiples: dict[str, set] = {}
    for index, heads in _key_heads(probe).items():
        if heads is None or heads % probe.kv_heads:
            return None
        multiples.setdefault(kinds[index], set()).add(heads // probe.kv_heads)
    if any(len(found) != 1 for found in multiples.values()):
        return None
    return tuple(sorted((kind, found.pop()) for kind, found in multiples.items() if found != {1}))


def key_heads_by_kind(probe) -> tuple[tuple, dict] | None:
    """(((layer kind, multiple of num_key_value_heads), ...), the config change that swaps the layer kinds), where
    config.layer_types' kinds set each layer's key/value heads (mimo_v2_flash's MiMoV2FlashAttention: its
    sliding_attention layers twice num_key_value_heads, set by the architecture's code, no config key): the same
    multiple for every layer of a kind, and following the kinds on a config with them swapped (not the layer
    index; the file's self-check runs that variant too). None where every layer has num_key_value_heads.
    Memoised on the probe."""
    if "key_heads_by_kind" in probe.memo:
        return probe.memo["key_heads_by_kind"]
    found = None
    # a config that sets them per layer (per_layer_config) states them: layer_key_heads reads those, no code rule
    rule = None if getattr(probe, "layer_kv_heads", None) else _kind_multiples(probe)
    kinds = getattr(probe.config, "layer_types", None)
    if rule and len(set(kinds[:len(probe.layers)])) == 2:
        first, second = sorted(set(kinds[:len(probe.layers)]))
        swapped = [second if kind == first else first if kind == second else kind for kind in kinds]
        try:
            other = probe.variant({"layer_types": swapped})
            follows = _kind_multiples(other) == rule
        except Exception:  # noqa: BLE001 - a config the architecture refuses: the rule not confirmed
            follows = False
        if follows:
            found = (rule, {"layer_types": swapped})
    probe.memo["key_heads_by_kind"] = found
    return found


def layer_key_heads(probe, index: int) -> int:
    """Layer `index`'s key/value heads: its own where the config sets them per layer (transformers' per_layer_config:
    gemma4's full layers' num_global_key_value_heads; the fused attention's KV_HEADS_PER_LAYER reads
    config.per_layer_config[layer_idx] at run time), else num_key_value_heads times its kind's multiple
    (key_heads_by_kind)."""
    per_layer = getattr(probe, "layer_kv_heads", None)
    if per_layer:
        return per_layer[index]
    found = key_heads_by_kind(probe)
    kinds = getattr(probe.config, "layer_types", None)
    return probe.kv_heads * (dict(found[0]).get(kinds[index], 1) if found else 1)
