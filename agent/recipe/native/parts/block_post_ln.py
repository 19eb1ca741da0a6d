"""The post-LN decoder layer (openai-gpt, the original Transformer's): each branch's output joins the residual
stream and the sum is normed, h = norm(h + attn(h)), then norm(h + mlp(h)) — the stream itself leaves each layer
normed, and the model has no final norm where its base model holds none. Held to the architecture's own layer
numerically."""

from __future__ import annotations

from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

POST_LN_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")
NORM_NAMES = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def _call(layer, x):
    """The layer's output hidden states on `x`, called as its architecture calls it (positional, or transformers'
    keyword shape); None where neither runs."""
    for kwargs in ({}, {"attention_mask": None, "position_ids": None, "position_embeddings": None}):
        try:
            got = layer(x, **kwargs)
        except Exception:  # noqa: BLE001 - another call shape: the next
            continue
        return got[0] if isinstance(got, (tuple, list)) else got
    return None


def post_ln_layer(layer, hidden: int) -> bool:
    """Whether the layer computes n = norm_a(x + attn(x)), then norm_m(n + mlp(n)): checked with the attention and
    the MLP replaced by fixed maps."""
    import torch

    gen = torch.Generator().manual_seed(9)
    a, m = (torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5 for _ in range(2))
    x = torch.randn(1, 3, hidden, generator=gen)
    attention, mlp = layer.self_attn, layer.mlp
    # the MLP as the layer's own linears (trocr's fc1 / activation_fn / fc2, read as a view by parts/layout.py): the
    # map in its up projection, the others passing it on
    own = not any(mlp is child for child in layer.children())
    replaced = (mlp.up_proj, mlp.act_fn, mlp.down_proj) if own else (mlp,)
    saved = [attention.forward] + [module.forward for module in replaced]
    try:
        # a list: openai-gpt's Block concatenates its tail to a list; others unpack (output, weights)
        attention.forward = lambda hidden_states, *args, **kwargs: [hidden_states @ a, None]
        replaced[0].forward = lambda hidden_states, *args, **kwargs: hidden_states @ m
        for module in replaced[1:]:
            module.forward = lambda hidden_states, *args, **kwargs: hidden_states
        with torch.no_grad():
            got = _call(layer, x)
    finally:
        attention.forward = saved[0]
        for module, forward in zip(replaced, saved[1:]):
            module.forward = forward
    if got is None:
        return False
    with torch.no_grad():
        n = layer.post_attention_layernorm(x + x @ a)
        want = layer.post_feedforward_layernorm(n + n @ m)
    return torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def _probe(probe, chosen):
    shapes = {tuple(n for n in NORM_NAMES if n in children(layer)) for layer in probe.layers}
    if shapes != {POST_LN_NORMS}:
        return None
    if not all(post_ln_layer(layer, probe.hidden) for layer in probe.layers):
        return None                # olmo2's post-norm h + norm(attn(h)): parts/block_post_norm.py
    final = "norm" in children(probe.base)
    return Match(POST_LN, options={"FINAL_NORM": final}, facts={"final_norm": final})


POST_LN = Part(slot="block", name="post_ln", code="block_post_ln.py", provides="ModelPostLnDecoderLayer",
               reads=("hidden_size",), probe=_probe, options=("FINAL_NORM",),
               kernels=lambda m: ((), ("post-LN residual adds: in the norm's call (npu_add_rms_norm where the norm "
                                       "is RMS; plain torch beside a LayerNorm)",)))
