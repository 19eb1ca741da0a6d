"""Scalar multipliers: the embedding times `embedding_multiplier`, the attention's and the MLP's outputs (normed,
in a sandwich layer: hyperclovax) times `residual_multiplier` (minicpm3: scale_depth / sqrt(num_hidden_layers))
before they join the residual, logits divided by
`logits_scaling` (granite), multiplied by it (hyperclovax), by `logit_scale` (cohere) or by `lm_head_multiplier`
(falcon_h1); the softmax scale `attention_multiplier` is the attention part's rule (parts/attention.py).
Each read from what transformers' model computes, not from the keys alone; the file reads the values from the
config at run time (code: parts/code/causal_lm.py EMBED_MULTIPLIER / LOGITS_SCALING, parts/code/block.py
RESIDUAL_MULTIPLIER): one part per slot it changes, all plain torch multiplies."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.block import block_roles, residual_scaled, role_options
from agent.recipe.native.parts.embedding import first_layer_input
from agent.recipe.native.parts.head import LM_HEAD
from agent.recipe.native.parts.part import Match, Part

MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_multiplier", "logit_scale",
               "scale_emb", "scale_depth", "lm_head_multiplier", "key_multiplier")


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


EMBED_KEYS = ("embedding_multiplier", "scale_emb")      # granite's, minicpm3's


def _embedding(probe, chosen):
    key = next((key for key in EMBED_KEYS if _number(probe.config, key) is not None), None)
    if key is None:
        return None
    import torch

    probe, multiplier = read_on(probe, key)
    got, table = first_layer_input(probe)
    if not torch.allclose(got, table * multiplier, rtol=1e-5, atol=1e-6):
        raise NotNative("model", f"the embedding is not scaled by config.{key}")
    key_option = {"EMBED_MULTIPLIER_KEY": key} if key != EMBED_KEYS[0] else {}
    return Match(EMBEDDING_MULTIPLIER, options={"EMBED_SCALE": False, "EMBED_MULTIPLIER": True, **key_option})


def residual_multiplier(probe):
    """(the probe to read it on, the layer's residual multiplier there, its rule): config.residual_multiplier
    (granite) or scale_depth / sqrt(num_hidden_layers) (minicpm3, "depth"); None where the config has neither."""
    found = read_on(probe, "residual_multiplier")
    if found is not None:
        return (*found, "key")
    found = read_on(probe, "scale_depth")
    if found is None:
        return None
    probe, depth = found
    return probe, depth / probe.config.num_hidden_layers ** 0.5, "depth"


def _block(layout: str):
    """The probe of the residual multiplier in a layer of `layout` ("pre_norm": input norms only; "sandwich": the
    outputs normed too)."""
    def probe_block(probe, chosen):
        found = residual_multiplier(probe)
        roles = block_roles(probe) if found is not None else None
        if roles is None or ("mlp_out" in roles) != (layout == "sandwich"):
            return None
        probe, multiplier, rule = found
        if not residual_scaled(probe.layers[0], probe.hidden, multiplier, roles):
            raise NotNative("decoder layer", "the layer's outputs are not scaled by " + (
                "config.residual_multiplier" if rule == "key" else "scale_depth / sqrt(num_hidden_layers)")
                + " before they join the residual")
        sandwich = {"SANDWICH": True} if layout == "sandwich" else {}
        depth = {"RESIDUAL_DEPTH_SCALED": True} if rule == "depth" else {}
        part = SANDWICH_RESIDUAL_MULTIPLIER if layout == "sandwich" else RESIDUAL_MULTIPLIER
        return Match(part, options={"RESIDUAL_MULTIPLIER": True, **sandwich, **depth, **role_options(roles)},
                     facts={"rule": rule})
    return probe_block


def _residual_kernels(what: str):
    def kernels(match):
        rule = "scale_depth / sqrt(num_hidden_layers)" if match.facts.get("rule") == "depth" else "residual_multiplier"
        return (), (f"{rule}: plain torch multiply {what}before npu_add_rms_norm",)
    return kernels


LOGITS_KEYS = ("logits_scaling", "logit_scale", "lm_head_multiplier")


def _head(probe, chosen):
    """logits_scaling (granite: the head's logits divided by it; hyperclovax: multiplied), logit_scale (cohere:
    multiplied) or lm_head_multiplier (falcon_h1: multiplied)."""
    key = next((key for key in LOGITS_KEYS if _number(probe.config, key) is not None), None)
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
    for divided, want in ((True, head / value), (False, head * value)):
        if torch.allclose(logits, want, rtol=1e-4, atol=1e-5):
            return Match(LOGITS_SCALING, options={"FINAL_SOFTCAP": False, "LOGITS_SCALING": key,
                                                  "LOGITS_DIVIDED": divided})
    raise NotNative("model", f"the logits are neither the head's divided nor multiplied by config.{key}")


def _variants(match, probe):
    """Another checkpoint's multipliers: the file reads each from the config."""
    return [("scalar multipliers", {key: 0.5 * (_number(probe.config, key) or 1.0) + 0.25 for key in MULTIPLIERS
                                    if _number(probe.config, key) is not None})]


EMBEDDING_MULTIPLIER = Part(
    slot="embedding", name="embedding_multiplier", code=None, provides=None,
    reads=("vocab_size", "hidden_size", "pad_token_id", "embedding_multiplier", "scale_emb"), probe=_embedding,
    options=("EMBED_SCALE", "EMBED_MULTIPLIER", "EMBED_MULTIPLIER_KEY"),
    kernels=lambda m: ((), ("embedding_multiplier: plain torch multiply",)))
RESIDUAL_MULTIPLIER = Part(
    slot="block", name="pre_norm_residual_multiplier", code="block.py", provides="ModelDecoderLayer",
    reads=("hidden_size", "rms_norm_eps", "residual_multiplier", "scale_depth", "num_hidden_layers"),
    probe=_block("pre_norm"), options=("RESIDUAL_MULTIPLIER", "RESIDUAL_DEPTH_SCALED", "ATTENTION_NORM", "MLP_NORM"),
    kernels=_residual_kernels(""))
SANDWICH_RESIDUAL_MULTIPLIER = Part(
    slot="block", name="sandwich_residual_multiplier", code="block.py", provides="ModelDecoderLayer",
    reads=("hidden_size", "rms_norm_eps", "residual_multiplier", "scale_depth", "num_hidden_layers"),
    probe=_block("sandwich"), options=("RESIDUAL_MULTIPLIER", "RESIDUAL_DEPTH_SCALED", "SANDWICH", "ATTENTION_NORM",
                                       "ATTENTION_OUT_NORM", "MLP_NORM", "MLP_OUT_NORM"),
    kernels=_residual_kernels("of the normed outputs "))
LOGITS_SCALING = Part(
    slot="head", name="lm_head_logits_scaling", code=None, provides=None,
    reads=("vocab_size", "tie_word_embeddings", *LOGITS_KEYS), probe=_head,
    options=("FINAL_SOFTCAP", "LOGITS_SCALING", "LOGITS_DIVIDED"), variants=lambda m, p: LM_HEAD.variants(m, p) + _variants(m, p),
    kernels=lambda m: ((), (f"{m.options['LOGITS_SCALING']}: plain torch scaling of the logits",)))
