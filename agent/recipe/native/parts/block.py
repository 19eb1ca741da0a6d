"""The decoder layer's shape: pre-norm (input and post-attention norms, the next norm adding the residual) or
sandwich (gemma2 / gemma3: the attention's and the MLP's outputs normed too) — the layers' norms as the
architecture builds them (a layer's other children: agent.recipe.native.parts.model refuses them)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.norm import LAYER_NORMS
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children


def layer_norms(probe) -> set:
    """The norms each layer has (one tuple for all layers, or NotNative)."""
    kinds = set()
    for layer in probe.layers:
        names = children(layer)
        present = tuple(n for n in LAYER_NORMS if n in names)
        if present not in (LAYER_NORMS[:2], LAYER_NORMS):
            raise NotNative("decoder layer", f"norms {present}: neither pre-norm nor sandwich")
        kinds.add(present)
    if len(kinds) != 1:
        raise NotNative("decoder layer", "layers of unequal structure")
    return kinds


def _pre_norm(probe, chosen):
    return Match(PRE_NORM) if layer_norms(probe) == {LAYER_NORMS[:2]} else None


def _sandwich(probe, chosen):
    return Match(SANDWICH, options={"SANDWICH": True}) if layer_norms(probe) == {LAYER_NORMS} else None


PRE_NORM = Part(slot="block", name="pre_norm", code="block.py", provides="ModelDecoderLayer",
                reads=("hidden_size", "rms_norm_eps"), probe=_pre_norm)
SANDWICH = Part(slot="block", name="sandwich", code="block.py", provides="ModelDecoderLayer",
                reads=("hidden_size", "rms_norm_eps"), probe=_sandwich, options=("SANDWICH",))
