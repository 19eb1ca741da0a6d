"""The pre-norm decoder layer whose first layer has no attention input norm (modernbert-decoder's layer 0 holds an
nn.Identity where the others hold attn_norm: its embedding is normed already): the first layer's attention takes
its input as it is, held to transformers' first layer numerically (x + attn(x), then + mlp(mlp_norm(.))); the other
layers are parts/block.py's pre-norm layer."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.block import PRE_NORM, _pre_norm, residual_scaled
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children


def unnormed_layers(probe, name: str) -> list:
    """The indices of the layers whose `name` child is an identity (nn.Identity, or a weightless map that returns its
    input)."""
    import torch

    x = torch.randn(2, probe.hidden, generator=torch.Generator().manual_seed(12))
    found = []
    for index, layer in enumerate(probe.layers):
        module = children(layer).get(name)
        if module is None or any(True for _ in module.parameters()):
            continue
        with torch.no_grad():
            if torch.equal(module(x), x):
                found.append(index)
    return found


def _probe(probe, chosen):
    match = _pre_norm(probe, chosen)
    if match is None:
        return None
    attention_norm = match.options["ATTENTION_NORM"]
    unnormed = unnormed_layers(probe, attention_norm)
    if not unnormed:
        return None
    if unnormed != [0]:
        raise NotNative("decoder layer", f"layers {unnormed} have no attention input norm: only the first layer's "
                                         "absence is written")
    roles = {"mlp_in": match.options["MLP_NORM"]}     # no attention_in: the identity
    if not residual_scaled(probe.layers[0], probe.hidden, 1.0, roles):
        raise NotNative("decoder layer", "the first layer, without an attention input norm, is not x + attn(x), then "
                                         "+ mlp(norm(.))")
    return Match(FIRST_UNNORMED, options={**match.options, "FIRST_LAYER_UNNORMED": True})


FIRST_UNNORMED = Part(slot="block", name="pre_norm_first_unnormed", code="block.py", provides="ModelDecoderLayer",
                      reads=PRE_NORM.reads, probe=_probe, options=(*PRE_NORM.options, "FIRST_LAYER_UNNORMED"),
                      kernels=lambda m: ((), ("the first layer's attention takes its input unnormed (no norm in "
                                              "its place)",)))
