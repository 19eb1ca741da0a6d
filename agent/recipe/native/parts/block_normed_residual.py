"""The decoder layer whose residual is its norm's output (minimax's): h = input_layernorm(x), s = alpha_a h +
beta_a attn(h), n = post_attention_layernorm(s), out = alpha_m n + beta_m mlp(n), written as
code/block_normed_residual.py. The factors are config keys (the attention's by the layer's type: linear_attn_* or
full_attn_*; the MLP's mlp_alpha_factor / mlp_beta_factor); the layer is held numerically to that formula, with its
attention and MLP replaced by fixed maps, on the config and on one with every factor set apart, so a factor read from
the wrong key fails."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

NORMS = ("input_layernorm", "post_attention_layernorm")
# config.layer_types' name -> its attention's factor keys (code/block_normed_residual.py's ATTENTION_FACTOR_KEYS)
ATTENTION_KEYS = {"linear_attention": "linear_attn", "full_attention": "full_attn"}
MLP_KEYS = ("mlp_alpha_factor", "mlp_beta_factor")
# distinct factors, so that one read from another key shows
APART = {"linear_attn_alpha_factor": 1.25, "linear_attn_beta_factor": 0.75, "full_attn_alpha_factor": 0.5,
         "full_attn_beta_factor": 1.5, "mlp_alpha_factor": 0.8, "mlp_beta_factor": 1.2}


def normed_residual_layer(layer, index: int, config, hidden: int) -> bool:
    """Whether layer `index` computes the normed-residual formula with `config`'s factors."""
    import torch

    kind = config.layer_types[index]
    if kind not in ATTENTION_KEYS:
        return False
    alpha_a, beta_a = (getattr(config, f"{ATTENTION_KEYS[kind]}_{x}_factor") for x in ("alpha", "beta"))
    alpha_m, beta_m = (getattr(config, key) for key in MLP_KEYS)
    gen = torch.Generator().manual_seed(9)
    a, m = (torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5 for _ in range(2))
    x = torch.randn(1, 3, hidden, generator=gen)
    names = children(layer)
    attention = names.get("linear_attn") or names.get("self_attn")
    mlp = names.get("mlp")
    if attention is None or mlp is None:
        return False
    saved = attention.forward, mlp.forward
    try:
        attention.forward = lambda hidden_states, *args, **kwargs: (hidden_states @ a, None)
        mlp.forward = lambda hidden_states, *args, **kwargs: hidden_states @ m
        with torch.no_grad():
            got = layer(x, attention_mask=None, position_ids=None, position_embeddings=None)
    except Exception:  # noqa: BLE001 - another call shape: not this layer
        return False
    finally:
        attention.forward, mlp.forward = saved
    got = got[0] if isinstance(got, tuple) else got
    with torch.no_grad():
        h = layer.input_layernorm(x)
        n = layer.post_attention_layernorm(alpha_a * h + beta_a * (h @ a))
        want = alpha_m * n + beta_m * (n @ m)
    return torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def _probe(probe, chosen):
    keys = {f"{prefix}_{x}_factor" for prefix in ATTENTION_KEYS.values() for x in ("alpha", "beta")} | set(MLP_KEYS)
    if not keys <= set(probe.config.to_dict()):
        return None
    if any(tuple(n for n in NORMS if n in children(layer)) != NORMS for layer in probe.layers):
        return None
    apart = probe.variant(APART)
    for reading in (probe, apart):
        for index, layer in enumerate(reading.layers):
            if not normed_residual_layer(layer, index, reading.config, reading.hidden):
                raise NotNative("decoder layer", f"layer {index} has the factor keys {sorted(keys)} but is not "
                                                 "norm(x) alpha + branch(norm(x)) beta")
    return Match(NORMED_RESIDUAL)


NORMED_RESIDUAL = Part(
    slot="block", name="normed_residual", code="block_normed_residual.py", provides="ModelNormedResidualDecoderLayer",
    reads=("hidden_size", "rms_norm_eps", "layer_types", *APART), probe=_probe,
    kernels=lambda m: (("npu_rms_norm (the layer's two norms)",),
                       ("the branches' alpha / beta weights and their sum: plain torch (the residual is the norm's "
                        "output, so npu_add_rms_norm does not apply)",)))
