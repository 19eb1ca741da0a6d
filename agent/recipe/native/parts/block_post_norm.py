"""The post-norm decoder layer (olmo2, olmo3, olmoe): no input norm; the attention's and the MLP's outputs normed
(post_attention_layernorm, post_feedforward_layernorm) before they join the residual — read from the layers'
norms and held to the architecture's own layer numerically."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")
NORM_NAMES = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def _probe_order(layer, hidden: int) -> None:
    """The layer computes h + post_attn(attn(h)), then that + post_ff(mlp(that)): checked with the attention and
    the MLP replaced by fixed maps."""
    import torch

    gen = torch.Generator().manual_seed(7)
    a, m = torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5, torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5
    attention, mlp = layer.self_attn, layer.mlp
    x = torch.randn(1, 3, hidden, generator=gen)

    def attend(hidden_states, *args, **kwargs):
        return hidden_states @ a, None

    saved = attention.forward, mlp.forward
    try:
        attention.forward, mlp.forward = attend, (lambda hidden_states, *args, **kwargs: hidden_states @ m)
        with torch.no_grad():
            got = layer(x, attention_mask=None, position_ids=None, position_embeddings=None)
    except Exception as exc:  # noqa: BLE001 - another call shape: not the layer this part writes
        raise NotNative("decoder layer", f"post-norm layer not callable as transformers' ({type(exc).__name__})") from exc
    finally:
        attention.forward, mlp.forward = saved
    got = got[0] if isinstance(got, tuple) else got
    with torch.no_grad():
        h = x + layer.post_attention_layernorm(x @ a)
        want = h + layer.post_feedforward_layernorm(h @ m)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise NotNative("decoder layer", "the post-norm layer is not h + norm(attn(h)), then h + norm(mlp(h))")


PRE_NORMS = ("input_layernorm", "post_attention_layernorm")


def _probe_linear_order(layer, hidden: int) -> None:
    """A hybrid's linear-attention layer beside post-norm attention layers (olmo_hybrid) is pre-norm: h + la(in(h)),
    then that + mlp(post_attn(that)), checked with the linear attention and the MLP replaced by fixed maps."""
    import torch

    gen = torch.Generator().manual_seed(8)
    a, m = (torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5 for _ in range(2))
    x = torch.randn(1, 3, hidden, generator=gen)
    linear, mlp = layer.linear_attn, layer.mlp
    saved = linear.forward, mlp.forward
    try:
        linear.forward = lambda hidden_states, *args, **kwargs: hidden_states @ a
        mlp.forward = lambda hidden_states, *args, **kwargs: hidden_states @ m
        with torch.no_grad():
            got = layer(x, attention_mask=None, position_ids=None, position_embeddings=None)
    except Exception as exc:  # noqa: BLE001 - another call shape: not the layer this part writes
        raise NotNative("decoder layer", f"linear-attention layer not callable as transformers' ({type(exc).__name__})") \
            from exc
    finally:
        linear.forward, mlp.forward = saved
    got = got[0] if isinstance(got, tuple) else got
    with torch.no_grad():
        h = x + layer.input_layernorm(x) @ a
        want = h + layer.post_attention_layernorm(h) @ m
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise NotNative("decoder layer", "the linear-attention layer is not h + la(norm(h)), then h + mlp(norm(h))")


def _post_norm(probe, chosen):
    linear = chosen.get("linear_attention") is not None
    shapes = {tuple(n for n in NORM_NAMES if n in children(layer))
              for layer in probe.layers if not (linear and hasattr(layer, "linear_attn"))}
    if shapes != {POST_NORMS}:
        return None
    attention = next(layer for layer in probe.layers if hasattr(layer, "self_attn"))
    _probe_order(attention, probe.hidden)
    if linear:
        layers = [layer for layer in probe.layers if hasattr(layer, "linear_attn")]
        if {tuple(n for n in NORM_NAMES if n in children(layer)) for layer in layers} != {PRE_NORMS}:
            raise NotNative("decoder layer", "linear-attention layers beside post-norm attention layers without "
                                             "input_layernorm / post_attention_layernorm")
        _probe_linear_order(layers[0], probe.hidden)
    return Match(POST_NORM)


POST_NORM = Part(slot="block", name="post_norm", code="block_post_norm.py", provides="ModelPostNormDecoderLayer",
                 reads=("hidden_size", "rms_norm_eps"), probe=_post_norm,
                 kernels=lambda m: ((), ("post-norm residual adds: plain torch (npu_add_rms_norm adds before it "
                                         "norms; these norm before they add)",)))
