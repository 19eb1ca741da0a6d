"""A model without attention layers: mamba2's Mamba2 layers alone (each layer one Mamba2 mixer behind one norm,
parts/block_one_mixer.py: the attention and MLP slots hold nothing), or a two-norm hybrid block whose every layer is
a linear-attention layer (granitemoehybrid's default layer_types: each layer a Mamba2 mixer and an MLP / MoE; the
MLP slot its own). The file neither builds an attention nor splits attention heads (code/causal_lm.py NO_ATTENTION);
a two-norm layer that config.layer_types makes an attention layer is refused when the file builds it
(code/layer.py)."""

from __future__ import annotations

from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.position_none import mamba2_only
from agent.recipe.native.parts.probe import children


def linear_only(probe) -> bool:
    """Every layer holds a linear-attention mixer and none an attention, under config.layer_types (read so by
    the hybrid block's code): the two-norm hybrid layers of a config of Mamba2 layers only."""
    return bool(probe.layers and getattr(probe.config, "layer_types", None)
                and all("linear_attn" in children(layer) and children(layer).get("self_attn") is None
                        for layer in probe.layers))


def _no_attention(probe, chosen):
    return Match(NO_ATTENTION, options={"NO_ATTENTION": True}) if mamba2_only(probe) or linear_only(probe) else None


def _no_mlp(probe, chosen):
    return Match(NO_MLP) if mamba2_only(probe) else None


NO_ATTENTION = Part(slot="attention", name="no_attention", code=None, provides=None, reads=(), probe=_no_attention,
                    options=("NO_ATTENTION",))
NO_MLP = Part(slot="mlp", name="no_mlp", code=None, provides=None, reads=(), probe=_no_mlp)
