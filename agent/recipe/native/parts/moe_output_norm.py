"""The sparse-MoE block whose output is RMS-normed (axk1's post_mlp_layernorm: the routed and shared experts' sum,
then the norm, inside the block): read from the block built as derive_moe builds it, the formula checked
numerically (derive_moe calls these probes). Its part row is parts/moe.py's SPARSE_MOE_OUTPUT_NORM, which sparse_moe's
probe picks where the block has such a norm (one derive_moe for both); its code (code/moe_output_norm.py) is
code/moe.py's block with the norm after the moe-tp sum."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.probe import probe_norm


def output_norm(block, hidden: int, config, known: set) -> str:
    """The name of the block's child that RMS-norms (x * w, config.rms_norm_eps) its whole output, "" where the
    block has no norm-shaped child (a 1-D weight of the hidden width) beside `known` (its router, experts, shared
    experts); NotNative for a norm it holds otherwise."""
    import torch

    found = [name for name, child in block.named_children() if name not in known
             and isinstance(getattr(child, "weight", None), torch.Tensor) and tuple(child.weight.shape) == (hidden,)]
    if not found:
        return ""
    if len(found) > 1:
        raise NotNative("moe", f"{type(block).__name__} holds several norms {found}: no part writes them")
    name = found[0]
    norm = getattr(block, name)
    try:
        offset = probe_norm(norm, hidden)
    except NotNative as exc:
        raise NotNative("moe", f"{type(block).__name__}.{name}: {exc.reason}") from exc
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if offset != 0.0 or eps != getattr(config, "rms_norm_eps", None):
        raise NotNative("moe", f"{type(block).__name__}.{name} is not x * w over the RMS with config.rms_norm_eps")
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(6, hidden, generator=gen)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen))
        saved = norm.forward
        try:
            norm.forward = lambda hidden_states, *args, **kwargs: hidden_states
            unnormed = block(x)
        finally:
            norm.forward = saved
        got = block(x)
    unnormed, got = (t[0] if isinstance(t, tuple) else t for t in (unnormed, got))
    want = unnormed * torch.rsqrt(unnormed.pow(2).mean(-1, keepdim=True) + eps) * norm.weight
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise NotNative("moe", f"{type(block).__name__}.{name} does not norm the block's whole output (routed and "
                               "shared experts summed)")
    return name


def same_norm_as_layers(probe, facts: dict) -> None:
    """The block's norm is the class the layers' norms are (the composition's norm part writes it)."""
    layer_norms = {type(child).__name__ for layer in probe.layers for name, child in layer.named_children()
                   if "norm" in name.lower()}
    if facts["output_norm_class"] not in layer_norms:
        raise NotNative("moe", f"the block's output norm {facts['output_norm_class']} is none of the layers' norms "
                               f"{sorted(layer_norms)}")
