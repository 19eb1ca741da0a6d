"""The parallel decoder layer (cohere, cohere2: GPT-J's layout): one norm, attention and MLP both on its output,
h + attn(norm(h)) + mlp(norm(h)) — read from the layers' norms (input_layernorm alone) and held to the
architecture's own layer numerically."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.block_post_norm import NORM_NAMES
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children


def _probe_parallel(layer, hidden: int) -> None:
    """The layer computes h + attn(norm(h)) + mlp(norm(h)): checked with the attention and the MLP replaced by
    fixed maps."""
    import torch

    gen = torch.Generator().manual_seed(9)
    a, m = (torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5 for _ in range(2))
    x = torch.randn(1, 3, hidden, generator=gen)
    attention, mlp = layer.self_attn, layer.mlp
    saved = attention.forward, mlp.forward
    try:
        attention.forward = lambda hidden_states, *args, **kwargs: (hidden_states @ a, None)
        mlp.forward = lambda hidden_states, *args, **kwargs: hidden_states @ m
        with torch.no_grad():
            got = layer(x, attention_mask=None, position_ids=None, position_embeddings=None)
    except Exception as exc:  # noqa: BLE001 - another call shape: not the layer this part writes
        raise NotNative("decoder layer", f"parallel layer not callable as transformers' ({type(exc).__name__})") from exc
    finally:
        attention.forward, mlp.forward = saved
    got = got[0] if isinstance(got, tuple) else got
    with torch.no_grad():
        normed = layer.input_layernorm(x)
        want = x + normed @ a + normed @ m
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise NotNative("decoder layer", "the one-norm layer is not h + attn(norm(h)) + mlp(norm(h))")


def _parallel(probe, chosen):
    shapes = {tuple(n for n in NORM_NAMES if n in children(layer)) for layer in probe.layers}
    if shapes != {("input_layernorm",)} or any(not hasattr(layer, "mlp") for layer in probe.layers):
        return None
    _probe_parallel(probe.layers[0], probe.hidden)
    return Match(PARALLEL)


PARALLEL = Part(slot="block", name="parallel", code="block_parallel.py", provides="ModelParallelDecoderLayer",
                reads=("hidden_size",), probe=_parallel,
                kernels=lambda m: ((), ("parallel attention + MLP: their outputs summed in plain torch",)))
