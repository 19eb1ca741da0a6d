"""The decoder layer of one mixer behind one norm (nemotron_h's blocks: an attention, a Mamba2 mixer or an MLP per
layer, config.layer_types naming which; mamba2's layers, a Mamba2 mixer each): read from the layers' children (the
layout's one_mixer, agent.recipe.native.parts.layout) and held numerically to the architecture's own layer of each
kind, h + mixer(norm(h)) with the mixer replaced by a fixed map. The file keeps the checkpoint's names for the norm
and the mixer (code/block_one_mixer.py)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

MIXERS = ("self_attn", "linear_attn", "mlp")
# the layer type config.layer_types gives each mixer (nemotron_h's names)
LAYER_TYPES = {"self_attn": "full_attention", "linear_attn": "linear_attention", "mlp": "mlp"}


def mixer_of(layer) -> str:
    return next(name for name in MIXERS if name in children(layer))


def one_mixer_residual(layer, hidden: int) -> bool:
    """The layer computes h + mixer(norm(h)): checked with its mixer replaced by a fixed map."""
    import torch

    gen = torch.Generator().manual_seed(9)
    a = torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5
    x = torch.randn(1, 3, hidden, generator=gen)
    name = mixer_of(layer)
    mixer, norm = children(layer)[name], children(layer)["input_layernorm"]
    saved = mixer.forward
    try:
        mixer.forward = ((lambda hidden_states, *args, **kwargs: (hidden_states @ a, None)) if name == "self_attn"
                         else (lambda hidden_states, *args, **kwargs: hidden_states @ a))
        with torch.no_grad():
            got = layer(x, attention_mask=None, position_ids=None)
    except Exception:  # noqa: BLE001 - another call shape: not the layer this part writes
        return False
    finally:
        mixer.forward = saved
    got = got[0] if isinstance(got, tuple) else got
    with torch.no_grad():
        want = x + norm(x) @ a
    return torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def _probe(probe, chosen):
    layout = probe.layout
    if layout is None or not layout.one_mixer:
        return None
    kinds = [mixer_of(layer) for layer in probe.layers]
    if "mlp" in kinds and chosen.get("moe") is not None:
        raise NotNative("decoder layer", "a sparse-MoE block as one layer's mixer, which no part writes")
    types = getattr(probe.config, "layer_types", None)
    if types is not None:
        want = [LAYER_TYPES[kind] for kind in kinds]
        if list(types[:len(kinds)]) != want:
            raise NotNative("decoder layer", f"its layers' mixers {want} are not config.layer_types' {types[:len(kinds)]}")
    elif set(kinds) != {"linear_attn"}:
        raise NotNative("decoder layer", f"mixers {sorted(set(kinds))} without a config.layer_types naming each layer's")
    for kind in dict.fromkeys(kinds):
        layer = probe.layers[kinds.index(kind)]
        if not one_mixer_residual(layer, probe.hidden):
            raise NotNative("decoder layer", f"its {kind} layer is not h + mixer(norm(h))")
    norm, mixer = layout.one_mixer
    # Mamba2 layers alone (mamba2): the file reads no layer types and builds no attention or MLP
    alone = set(kinds) == {"linear_attn"} and chosen.get("attention") is not None \
        and chosen["attention"].options.get("NO_ATTENTION")
    return Match(ONE_MIXER, options={"ONE_MIXER": True, "MIXER_NAME": mixer, "MIXER_NORM": norm,
                                     **({"MIXER_LAYER_TYPES": False} if alone else {})})


ONE_MIXER = Part(slot="block", name="one_mixer", code="block_one_mixer.py", provides="ModelOneMixerDecoderLayer",
                 reads=("hidden_size", "layer_types"), probe=_probe,
                 options=("ONE_MIXER", "MIXER_NAME", "MIXER_NORM", "MIXER_LAYER_TYPES", "ATTENTION_LAYER_TYPE",
                          "MLP_LAYER_TYPE"))
