"""No positions on any layer unless the config turns the rotary on (granitemoehybrid: position_embedding_type None or
"nope" builds no rotary table and hands every attention layer none; "rope" rotates them all). Read off
transformers' model: no rotary table in the base model, none handed to any attention layer, and the config with the
switch set to "rope" builds one, rotate-half. The file reads the switch at run time, so one file serves both kinds of
checkpoint (code: parts/code/attention_fused.py NOPE_LAYERS "position_embedding_type", the rotary skipped on every
layer; the cos / sin table parts/code/rotary.py's, built and read by no layer where the switch is off)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.mla import is_mla_model
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.position import ROTARY, TYPED_OPTIONS, probe_rotate_half, rope_match
from agent.recipe.native.parts.probe import children
from agent.recipe.native.parts.rotary_nope import handed_no_table

# the config key that switches the rotary on, and its value that does (read by name in the code's layer_uses_rope)
SWITCH, ROPE_ON = "position_embedding_type", "rope"


def _probe(probe, chosen):
    if is_mla_model(probe) or probe.base is None or not probe.layers:
        return None
    own = children(probe.base)
    if own.get("rotary_emb") is not None or own.get("embed_positions") is not None:
        return None
    if SWITCH not in probe.config_dict and not hasattr(probe.config, SWITCH):
        return None                      # no rotary and no switch: ALiBi, or no part of this kind
    kind = getattr(probe.config, SWITCH, None)
    if kind == ROPE_ON:
        raise NotNative("position", f"{SWITCH} {kind!r} and yet no rotary table in the base model")
    attending = {i for i, layer in enumerate(probe.layers) if getattr(layer, "self_attn", None) is not None}
    untabled = handed_no_table(probe) if attending else set()
    if attending - untabled:
        raise NotNative("position", f"{SWITCH} {kind!r}: no rotary table, yet layers {sorted(attending - untabled)} "
                                    "are handed positions by no rule the file reads")
    rope = probe.variant({SWITCH: ROPE_ON})
    if children(rope.base).get("rotary_emb") is None:
        raise NotNative("position", f"{SWITCH} {kind!r}: attention without positions (NoPE), and {SWITCH} "
                                    f"{ROPE_ON!r} builds no rotary table either: no rule the file reads")
    probe_rotate_half(probe.modeling)
    match = rope_match(rope, NOPE_ALL, {"NOPE_LAYERS": SWITCH})
    return Match(NOPE_ALL, options=match.options, facts={**match.facts, "switch": kind})


def _variants(match: Match, probe):
    """The rotary switched on (every rope type of the plain rotary part's, on that setting): the file reads the
    switch from each checkpoint's config."""
    rope = probe.variant({SWITCH: ROPE_ON})
    found = [(f"{SWITCH} {ROPE_ON}", {SWITCH: ROPE_ON})]
    found += [(f"{SWITCH} {ROPE_ON}, {label}", {SWITCH: ROPE_ON, **changes})
              for label, changes in ROTARY.variants(match, rope)]
    return found


NOPE_ALL = Part(
    slot="position", name="nope_unless_rope", code="rotary.py", provides="ModelRotaryEmbedding",
    reads=ROTARY.reads + (SWITCH,), probe=_probe, options=("ROPE_BY_LAYER_TYPE", "NOPE_LAYERS") + TYPED_OPTIONS,
    variants=_variants,
    kernels=lambda m: ((), (f"no positions: {SWITCH} {m.facts['switch']!r} (rotary where a checkpoint's config says "
                            f"{ROPE_ON!r})",)))
