"""Norms: RMSNorm x * w (rms_norm) and x * (1 + w) (offset_rms_norm, gemma's), read numerically from every norm
of the architecture's layers (input, post-attention, pre/post-feedforward, q/k) and its final norm."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.norm_eps import EPS_KEYS, eps_follows, stated_eps
from agent.recipe.native.parts.norm_roles import layer_norm_names
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children, probe_norm

LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
QK_NORMS = ("q_norm", "k_norm", "query_layernorm", "key_layernorm")     # hunyuan: query_ / key_layernorm


def model_norms(probe, full_width_qk: bool = True):
    """(norm, width) of every norm of the model: each layer's norms (read by role, and LAYER_NORMS by name), its
    attention's q/k norms and the final norm — the one walk the norm parts probe (norm_offsets here,
    parts/norm_layer.py's layer_norm_facts). A q/k norm's width is per head, or with `full_width_qk` over all heads'
    width where its weight has that width (olmo2: agent.recipe.native.parts.attention reads which)."""
    import torch

    for layer in probe.layers:
        kinds = children(layer)
        for name in layer_norm_names(probe, layer, LAYER_NORMS):
            if isinstance(kinds[name], torch.nn.Identity):
                continue        # no norm in that place (modernbert-decoder's first layer): parts/block_first_unnormed.py
            yield kinds[name], probe.hidden
        attention = kinds.get("self_attn")
        for name in QK_NORMS:
            norm = getattr(attention, name, None) if attention is not None else None
            if norm is not None:
                width = probe.head_dim
                if full_width_qk:
                    width = getattr(getattr(norm, "weight", None), "shape", (probe.head_dim,))[-1]
                    if width not in (probe.head_dim, probe.heads * probe.head_dim, probe.kv_heads * probe.head_dim):
                        width = probe.head_dim
                yield norm, width
    final = getattr(probe.base, "norm", None)
    if final is not None:
        yield final, probe.hidden


def norm_offsets(probe) -> set:
    """The offsets (0: x * w, 1: x * (1 + w)) of the model's norms; NotNative for a norm that is neither."""
    if "norm_offsets" not in probe.memo:
        offsets = {probe_norm(norm, width) for norm, width in model_norms(probe)}
        if len(offsets) > 1:
            raise NotNative("norm", "RMSNorms of both x * w and x * (1 + w) in one model")
        probe.memo["norm_offsets"] = offsets
    return probe.memo["norm_offsets"]


def eps_option(probe) -> dict:
    """{} where the config holds rms_norm_eps (the code's key); else {"NORM_EPS": the key} of the config key the
    RMSNorms' epsilon follows (lfm2's norm_eps), or NotNative."""
    import math

    config = probe.config.to_dict()
    if isinstance(getattr(probe.config, "rms_norm_eps", None), float):
        return {}                   # under its own name, or another the config class maps it to
    norm = getattr(probe.base, "norm", None) or children(probe.layers[0]).get("input_layernorm")
    eps = stated_eps(norm, probe.hidden) if norm is not None else None
    key = next((k for k in EPS_KEYS if isinstance(eps, float) and isinstance(config.get(k), float)
                and math.isclose(config[k], eps) and eps_follows(probe, k, eps)), None)
    if key is None:
        raise NotNative("norm", f"no rms_norm_eps in the config, and the RMSNorms' epsilon {eps} is no config key's "
                                f"({', '.join(EPS_KEYS)})")
    return {"NORM_EPS": key}


def _rms(probe, chosen):
    return Match(RMS_NORM, options=eps_option(probe)) if norm_offsets(probe) == {0.0} else None


def _offset(probe, chosen):
    return Match(OFFSET_RMS_NORM, options=eps_option(probe)) if norm_offsets(probe) == {1.0} else None


RMS_NORM = Part(
    slot="norm", name="rms_norm", code="norm_rms.py", provides="ModelRMSNorm", reads=("rms_norm_eps",), probe=_rms, options=("NORM_EPS",),
    kernels=lambda m: (("npu_rms_norm / npu_add_rms_norm (residual add fused)",), ()))
OFFSET_RMS_NORM = Part(
    slot="norm", name="offset_rms_norm", code="norm_offset_rms.py", provides="ModelOffsetRMSNorm",
    reads=("rms_norm_eps",), probe=_offset, options=("NORM_EPS",),
    kernels=lambda m: (("npu_rms_norm / npu_add_rms_norm (residual add fused), gemma's 1 + w loaded into the weight",), ()))
