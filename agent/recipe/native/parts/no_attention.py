"""A model of Mamba2 layers alone (mamba2: each layer one Mamba2 mixer behind one norm, parts/block_one_mixer.py):
the attention and MLP slots hold nothing, and the file neither builds an attention nor splits attention heads
(code/causal_lm.py NO_ATTENTION). Matched only where no layer has an attention or an MLP."""

from __future__ import annotations

from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.position_none import mamba2_only


def _no_attention(probe, chosen):
    return Match(NO_ATTENTION, options={"NO_ATTENTION": True}) if mamba2_only(probe) else None


def _no_mlp(probe, chosen):
    return Match(NO_MLP) if mamba2_only(probe) else None


NO_ATTENTION = Part(slot="attention", name="no_attention", code=None, provides=None, reads=(), probe=_no_attention,
                    options=("NO_ATTENTION",))
NO_MLP = Part(slot="mlp", name="no_mlp", code=None, provides=None, reads=(), probe=_no_mlp)
