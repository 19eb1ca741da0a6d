"""How a recipe is split over cards: the model's tensor-parallel plan as checkpoint-key patterns, and the
YAML / render values for N cards (what the recipe spec renders and the memory estimate measures)."""

from __future__ import annotations

import re

from agent.errors import InputError, UnsupportedModelError
from engine.parallel import families_with_tp_plan, tp_plan


def plan_patterns(config: dict) -> list[re.Pattern] | None:
    """The model's tensor-parallel plan (engine.parallel.tp_plan of its configuration class) as regexes
    over checkpoint keys; None: the family has none. Embeddings and lm_head are sharded too
    (transformers adds them to every plan it applies)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    text = config.get("text_config") or {}
    try:
        classes = [CONFIG_MAPPING[t] for t in (config.get("model_type"), text.get("model_type")) if t in CONFIG_MAPPING]
    except ImportError:   # a configuration module transformers cannot import here
        classes = []
    plan = next((found for cls in classes if (found := tp_plan(cls))), None)
    if not plan:
        return None
    keys = [*plan, "embed_tokens", "lm_head"]
    return [re.compile(r"(^|\.)" + re.escape(k).replace(r"\*", r"\d+") + r"(\.|$)") for k in keys
            if not plan.get(k, "").startswith("replicated")]


def parallel_settings(config: dict, world_size: int) -> dict:
    """Render-context / YAML values for `world_size` cards (config: the checkpoint's config.json): all
    of them one tensor-parallel group (attention, MoE experts and lm_head sharded by the model's
    plan). Refuses a family without a plan."""
    if world_size < 1:
        raise InputError(f"--world-size must be >= 1, got {world_size}")
    if world_size > 1 and plan_patterns(config) is None:
        raise UnsupportedModelError(
            f"{config.get('model_type')} has no tensor-parallel plan, so it cannot be split over {world_size} cards; "
            f"families with one: {', '.join(families_with_tp_plan())}")
    return {"world_size": world_size, "attn_tp_size": world_size, "moe_tp_size": world_size,
            "lmhead_tp_size": world_size}
