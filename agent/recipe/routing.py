"""Routing table: config features -> template family and the notes a Runner needs.

Like vLLM's model registry this is data: adding a family is one row in FAMILIES plus one in
ROUTES (and a test). Families are detected from config *features*, not model names, so an
unseen architecture with a known structure routes correctly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Family:
    name: str
    runner_template: str      # templates/<runner_template>
    reference_recipe: str     # upstream cann-recipes-infer recipe to read for this structure
    notes: str                # cache layout, mask kinds, special inputs


FAMILIES = {
    "standard": Family(
        "standard", "runner.py.j2", "models/gpt_oss",
        "dense MHA/GQA; KV cache [batch, kv_heads, seq, head_dim] per layer; causal mask from a 2D "
        "padding mask; inputs input_ids, attention_mask, position_ids"),
    "sliding_window": Family(
        "sliding_window", "runner.py.j2", "models/gpt_oss",
        "sliding-window or hybrid attention (config layer_types / sliding_window); per-layer cache "
        "kinds (sliding layers keep the last window only); causal + sliding masks"),
    "hybrid_recurrent": Family(
        "hybrid_recurrent", "runner.py.j2", "models/longcat-flash",
        "linear-attention or state-space (Mamba) layers mixed with attention: per-layer recurrent "
        "state instead of a growing KV cache; the model builds its own cache type at prefill"),
    "moe": Family(
        "moe", "runner.py.j2", "models/qwen3_moe",
        "mixture of experts (router top-k over experts, optional shared experts); standard KV "
        "cache; expert weights dominate memory, KV cache per token is as for dense"),
    "mla": Family(
        "mla", "runner.py.j2", "models/deepseek_r1",
        "multi-head latent attention (kv_lora_rank): cache holds the compressed latent + rope key; "
        "usually combined with MoE layers after first_k_dense_replace dense ones"),
}


def _get(config: dict, *keys, default=None):
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def _expert_count(config: dict) -> int:
    return int(_get(config, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
                    default=0) or 0)


def _has_recurrent_layers(config: dict) -> bool:
    layer_types = config.get("layer_types") or []
    if any("linear" in str(kind) or "mamba" in str(kind) for kind in layer_types):
        return True
    return any(key.startswith(("mamba_", "linear_num_")) for key in config)


def _has_sliding(config: dict) -> bool:
    layer_types = config.get("layer_types") or []
    if any("sliding" in str(kind) or "local" in str(kind) for kind in layer_types):
        return True
    return bool(config.get("sliding_window")) and config.get("use_sliding_window", True) is not False


# Ordered: the first matching row wins (MLA before MoE: DeepSeek-V3 is both).
ROUTES: list[tuple[str, Callable[[dict], bool]]] = [
    ("mla", lambda c: bool(c.get("kv_lora_rank"))),
    ("hybrid_recurrent", _has_recurrent_layers),
    ("moe", lambda c: _expert_count(c) > 1),
    ("sliding_window", _has_sliding),
    ("standard", lambda c: True),
]


def route(config: dict) -> Family:
    """Family for a text config (a config.json dict; for multimodal configs pass text_config)."""
    for name, matches in ROUTES:
        if matches(config):
            return FAMILIES[name]
    raise AssertionError("the last route matches everything")


def supported_families() -> str:
    return ", ".join(FAMILIES)
