"""Head width per layer (gemma4's full-attention layers at global_head_dim 512 beside its sliding layers' head_dim
256): transformers' heterogeneous config (per_layer_config) sets head_dim per layer and refuses a global read of
it. Read from the layers, not from a per-model table: each attention layer's q_proj and k_proj must be the config's
heads times that layer's own head_dim, and its q/k norms that wide (parts/attention.py checks both layer by layer).
The fused attention part writes it as the option HEAD_DIM_PER_LAYER: each layer's attention takes its head_dim
from config.per_layer_config[layer_idx] (its softmax scale by the head_dim rule too), and so its paged cache
entries have that layer's width (the executor allocates a cache entry per layer)."""

from __future__ import annotations

# what transformers' per_layer_config may set per layer for a file the generator writes: the head width and the
# key/value heads (gemma4's full layers' num_global_key_value_heads; parts/attention_heads.py's layer_key_heads);
# any other attribute set per layer — dots3's MLA ranks and query heads — still refuses: parts/probe.py
WRITTEN_PER_LAYER = ("head_dim", "num_key_value_heads")


def per_layer_ints(config, name: str) -> list[int] | None:
    """Each layer's `name` where `config` sets it per layer (per_layer_config) as a positive int, else None."""
    try:
        names = set(getattr(config, "per_layer_attributes", None) or ())
    except RuntimeError:
        return None
    if name not in names:
        return None
    values = [getattr(config.per_layer_config[layer], name, None) for layer in range(config.num_hidden_layers)]
    return values if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values) else None


def layer_head_dims(config) -> list[int] | None:
    """Each layer's head_dim where `config` sets it per layer (per_layer_config), else None."""
    return per_layer_ints(config, "head_dim")


def layer_head_dim(probe, index: int) -> int:
    """Layer `index`'s head width: its own where the config sets it per layer, else the probe's."""
    dims = getattr(probe, "layer_head_dims", None)
    return dims[index] if dims else probe.head_dim
