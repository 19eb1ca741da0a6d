"""The parallel decoder layer (cohere, cohere2, phi: GPT-J's layout): one norm, attention and MLP both on its
output, h + attn(norm(h)) + mlp(norm(h)) — read from the layers' norms (input_layernorm alone) and held to the
architecture's own layer numerically; and gpt_neox's on two norms, h + attn(norm(h)) + mlp(norm2(h)), or the
sequential pre-norm layer where its config key (use_parallel_residual) is false."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.block_post_norm import NORM_NAMES
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children


def _probe_parallel(layer, hidden: int, mlp_norm: bool = False) -> None:
    """The layer computes h + attn(norm(h)) + mlp(norm(h)) (`mlp_norm`: mlp(norm2(h)), the MLP's own norm): checked
    with the attention and the MLP replaced by fixed maps."""
    import inspect

    import torch

    gen = torch.Generator().manual_seed(9)
    a, m = (torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5 for _ in range(2))
    x = torch.randn(1, 3, hidden, generator=gen)
    attention, mlp = layer.self_attn, layer.mlp
    saved = attention.forward, mlp.forward
    try:
        attention.forward = lambda hidden_states, *args, **kwargs: (hidden_states @ a, None)
        mlp.forward = lambda hidden_states, *args, **kwargs: hidden_states @ m
        # falcon's layer takes its alibi tensor (None where it rotates) before the mask
        alibi = {"alibi": None} if "alibi" in inspect.signature(layer.forward).parameters else {}
        with torch.no_grad():
            got = layer(x, attention_mask=None, position_ids=None, position_embeddings=None, **alibi)
    except Exception as exc:  # noqa: BLE001 - another call shape: not the layer this part writes
        raise NotNative("decoder layer", f"parallel layer not callable as transformers' ({type(exc).__name__})") from exc
    finally:
        attention.forward, mlp.forward = saved
    got = got[0] if isinstance(got, tuple) else got
    with torch.no_grad():
        normed = layer.input_layernorm(x)
        want = x + normed @ a + (layer.post_attention_layernorm(x) if mlp_norm else normed) @ m
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        if mlp_norm:
            raise NotNative("decoder layer", "the two-norm layer is not h + attn(norm(h)) + mlp(norm2(h))")
        raise NotNative("decoder layer", "the one-norm layer is not h + attn(norm(h)) + mlp(norm(h))")


def _parallel(probe, chosen):
    shapes = {tuple(n for n in NORM_NAMES if n in children(layer)) for layer in probe.layers}
    if shapes != {("input_layernorm",)} or any(not hasattr(layer, "mlp") for layer in probe.layers):
        return None
    _probe_parallel(probe.layers[0], probe.hidden)
    return Match(PARALLEL)


def _two_norms(probe, chosen):
    """gpt_neox's layer: h + attn(norm(h)) + mlp(norm2(h)) where config.use_parallel_residual says so, else the
    sequential pre-norm layer (checked on the config with the key toggled); None where the layer is sequential and
    no key makes it parallel (the pre-norm part's)."""
    shapes = {tuple(n for n in NORM_NAMES if n in children(layer)) for layer in probe.layers}
    # every layer an attention and an MLP (a hybrid's linear-attention layers are the pre-norm part's)
    if shapes != {("input_layernorm", "post_attention_layernorm")} \
            or any(not (hasattr(layer, "mlp") and hasattr(layer, "self_attn")) for layer in probe.layers):
        return None
    try:
        _probe_parallel(probe.layers[0], probe.hidden, mlp_norm=True)
    except NotNative:
        return None
    key = next((k for k in PARALLEL_KEYS if getattr(probe.config, k, None) is True), None)
    if key is None and not any(k in probe.config.to_dict() for k in PARALLEL_KEYS):
        # no key of the layout in the config (falcon's new architecture): parallel always
        return Match(PARALLEL_TWO_NORMS, options={"MLP_NORM": True}, facts={"key": None})
    if key is None:
        raise NotNative("decoder layer", "a two-norm parallel layer that no config key makes sequential: "
                                         f"none of {', '.join(PARALLEL_KEYS)} is set")
    sequential = probe.variant({key: False})
    try:
        _probe_parallel(sequential.layers[0], sequential.hidden, mlp_norm=True)
    except NotNative:
        return Match(PARALLEL_TWO_NORMS, options={"MLP_NORM": True, "PARALLEL_KEY": key}, facts={"key": key})
    raise NotNative("decoder layer", f"the two-norm layer stays parallel with {key} false")


def _variants(match, probe):
    """The file serves the other setting of the key: the sequential pre-norm layer."""
    return [(match.facts["key"] + " off", {match.facts["key"]: False})] if match.facts["key"] else []


# config keys that choose a parallel layer (True) or the sequential pre-norm one
PARALLEL_KEYS = ("use_parallel_residual",)

PARALLEL = Part(slot="block", name="parallel", code="block_parallel.py", provides="ModelParallelDecoderLayer",
                reads=("hidden_size",), probe=_parallel,
                kernels=lambda m: ((), ("parallel attention + MLP: their outputs summed in plain torch",)))
PARALLEL_TWO_NORMS = Part(
    slot="block", name="parallel_two_norms", code="block_parallel.py", provides="ModelParallelDecoderLayer",
    reads=("hidden_size", "use_parallel_residual"), probe=_two_norms, options=("MLP_NORM", "PARALLEL_KEY"),
    variants=_variants,
    kernels=lambda m: ((), ("parallel attention + MLP on two norms: their outputs summed in plain torch",)))
