"""Head width per layer (gemma4's full-attention layers at global_head_dim 512 beside its sliding layers' head_dim
256): transformers' heterogeneous config (per_layer_config) sets head_dim per layer and refuses a global read of
it. Read from the layers, not from a per-model table: each attention layer's q_proj and k_proj must be the config's
heads times that layer's own head_dim, and its q/k norms that wide (parts/attention.py checks both layer by layer).
The fused attention part writes it as the option HEAD_DIM_PER_LAYER: each layer's attention takes its head_dim
from config.per_layer_config[layer_idx] (its softmax scale by the head_dim rule too), and so its paged cache
entries have that layer's width (the executor allocates a cache entry per layer)."""

from __future__ import annotations

# what transformers' per_layer_config may set per layer for a file the generator writes: the head width (any
# other attribute set per layer — dots3's MLA ranks and head counts — still refuses: parts/probe.py)
WRITTEN_PER_LAYER = ("head_dim",)


def layer_head_dims(config) -> list[int] | None:
    """Each layer's head_dim where `config` sets it per layer (per_layer_config), else None."""
    try:
        names = set(getattr(config, "per_layer_attributes", None) or ())
    except RuntimeError:
        return None
    if "head_dim" not in names:
        return None
    dims = [getattr(config.per_layer_config[layer], "head_dim", None) for layer in range(config.num_hidden_layers)]
    return dims if all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims) else None


def layer_head_dim(probe, index: int) -> int:
    """Layer `index`'s head width: its own where the config sets it per layer, else the probe's."""
    dims = getattr(probe, "layer_head_dims", None)
    return dims[index] if dims else probe.head_dim
