"""A refusal, not a part that writes code: a self_attn that is a linear attention with a per-head decay (minimax's
lightning attention: a slope_rate buffer, an output gate) is named as such, so that a type with such layers falls
back on its first blocker rather than on the softmax attention parts' list of modules they do not know."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.attention import attention_layers
from agent.recipe.native.parts.part import Part


def _lightning(probe, chosen):
    for index in attention_layers(probe):
        module = probe.layers[index].self_attn
        if hasattr(module, "slope_rate") and hasattr(module, "output_gate"):
            raise NotNative("attention", f"layer {index}: {type(module).__name__} is a linear attention with a "
                                         "per-head decay (slope_rate), which no part writes")
    return None


LIGHTNING_REFUSED = Part(slot="attention", name="lightning_refused", code=None, provides=None, reads=(),
                         probe=_lightning)
