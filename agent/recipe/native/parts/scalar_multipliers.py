"""Scalar multipliers: the embedding times `embedding_multiplier`, the attention's and the MLP's outputs times
`residual_multiplier` before they join the residual, logits divided by `logits_scaling` (granite) or multiplied by
`logit_scale` (cohere); the softmax scale `attention_multiplier` is the attention part's rule (parts/attention.py).
Each read from what transformers' model computes, not from the keys alone; the file reads the values from the
config at run time (code: parts/code/causal_lm.py EMBED_MULTIPLIER / LOGITS_SCALING, parts/code/block.py
RESIDUAL_MULTIPLIER): one part per slot it changes, all plain torch multiplies."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.block import layer_norms
from agent.recipe.native.parts.embedding import first_layer_input
from agent.recipe.native.parts.head import LM_HEAD
from agent.recipe.native.parts.model import layer_mlp
from agent.recipe.native.parts.norm import LAYER_NORMS
from agent.recipe.native.parts.part import Match, Part

MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_multiplier", "logit_scale")


def _number(config, key):
    value = getattr(config, key, None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def read_on(probe, key: str):
    """(the probe to read `key`'s effect on, its value there), or None where the config has no such number: at
    1.0 the multiplier's effect cannot be seen, so it is read on the config with the key at 2.5 (the file then
    serves the family's checkpoints whose value is not 1)."""
    value = _number(probe.config, key)
    if value is None:
        return None
    return (probe, value) if value != 1.0 else (probe.variant({key: 2.5}), 2.5)


def _embedding(probe, chosen):
    found = read_on(probe, "embedding_multiplier")
    if found is None:
        return None
    import torch

    probe, multiplier = found
    got, table = first_layer_input(probe)
    if not torch.allclose(got, table * multiplier, rtol=1e-5, atol=1e-6):
        raise NotNative("model", "the embedding is not scaled by config.embedding_multiplier")
    return Match(EMBEDDING_MULTIPLIER, options={"EMBED_SCALE": False, "EMBED_MULTIPLIER": True})


def residual_scaled(layer, hidden: int, multiplier: float) -> bool:
    """The pre-norm layer computes h = x + m * attn(norm(x)), then h + m * mlp(norm(h)): checked with the
    attention and the MLP replaced by fixed maps."""
    import torch

    gen = torch.Generator().manual_seed(8)
    a, b = (torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5 for _ in range(2))
    x = torch.randn(1, 3, hidden, generator=gen)
    attention, mlp = layer.self_attn, layer_mlp(layer)
    saved = attention.forward, mlp.forward
    try:
        attention.forward = lambda hidden_states, *args, **kwargs: (hidden_states @ a, None)
        mlp.forward = lambda hidden_states, *args, **kwargs: hidden_states @ b
        with torch.no_grad():
            got = layer(x, attention_mask=None, position_ids=None, position_embeddings=None)
    except Exception:  # noqa: BLE001 - another call shape: not the layer this part writes
        return False
    finally:
        attention.forward, mlp.forward = saved
    got = got[0] if isinstance(got, tuple) else got
    with torch.no_grad():
        h = x + multiplier * (layer.input_layernorm(x) @ a)
        want = h + multiplier * (layer.post_attention_layernorm(h) @ b)
    return torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def _block(probe, chosen):
    found = read_on(probe, "residual_multiplier")
    if found is None or layer_norms(probe) != {LAYER_NORMS[:2]}:
        return None
    probe, multiplier = found
    if not residual_scaled(probe.layers[0], probe.hidden, multiplier):
        raise NotNative("decoder layer", "the layer's outputs are not scaled by config.residual_multiplier "
                                         "before they join the residual")
    return Match(RESIDUAL_MULTIPLIER, options={"RESIDUAL_MULTIPLIER": True})


def _head(probe, chosen):
    """logits_scaling (granite: the head's logits divided by it) or logit_scale (cohere: multiplied)."""
    key = next((key for key in ("logits_scaling", "logit_scale") if _number(probe.config, key) is not None), None)
    if key is None:
        return None
    import torch

    probe, value = read_on(probe, key)
    seen = {}

    def keep(module, args, out):
        seen["h"] = out.detach()

    handle = probe.base.norm.register_forward_hook(keep)
    try:
        with torch.no_grad():
            logits = probe.model(input_ids=torch.tensor([[3, 5, 7]]), use_cache=False).logits
    finally:
        handle.remove()
    with torch.no_grad():
        head = probe.model.lm_head(seen["h"])
    if not torch.allclose(logits, head / value if key == "logits_scaling" else head * value, rtol=1e-4, atol=1e-5):
        raise NotNative("model", f"the logits are not the head's {'divided' if key == 'logits_scaling' else 'multiplied'} "
                                 f"by config.{key}")
    return Match(LOGITS_SCALING, options={"FINAL_SOFTCAP": False, "LOGITS_SCALING": key})


def _variants(match, probe):
    """Another checkpoint's multipliers: the file reads each from the config."""
    return [("scalar multipliers", {key: 0.5 * (_number(probe.config, key) or 1.0) + 0.25 for key in MULTIPLIERS
                                    if _number(probe.config, key) is not None})]


EMBEDDING_MULTIPLIER = Part(
    slot="embedding", name="embedding_multiplier", code=None, provides=None,
    reads=("vocab_size", "hidden_size", "pad_token_id", "embedding_multiplier"), probe=_embedding,
    options=("EMBED_SCALE", "EMBED_MULTIPLIER"),
    kernels=lambda m: ((), ("embedding_multiplier: plain torch multiply",)))
RESIDUAL_MULTIPLIER = Part(
    slot="block", name="pre_norm_residual_multiplier", code="block.py", provides="ModelDecoderLayer",
    reads=("hidden_size", "rms_norm_eps", "residual_multiplier"), probe=_block, options=("RESIDUAL_MULTIPLIER",),
    kernels=lambda m: ((), ("residual_multiplier: plain torch multiply before npu_add_rms_norm",)))
LOGITS_SCALING = Part(
    slot="head", name="lm_head_logits_scaling", code=None, provides=None,
    reads=("vocab_size", "tie_word_embeddings", "logits_scaling", "logit_scale"), probe=_head,
    options=("FINAL_SOFTCAP", "LOGITS_SCALING"), variants=lambda m, p: LM_HEAD.variants(m, p) + _variants(m, p),
    kernels=lambda m: ((), (f"{m.options['LOGITS_SCALING']}: plain torch scaling of the logits",)))
