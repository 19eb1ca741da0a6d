"""Interleaved rotary (glm, ernie4_5, cohere; gptj and codegen, partial by config.rotary_dim): the architecture rotates each pair (2i, 2i + 1) of a head's rotary
dims by frequency i, where rotate-half rotates (i, rotary_dim / 2 + i). Attention scores are q . k, unchanged when
q and k have their dims reordered alike: the file reorders the rotary rows of the q and k projections once at load
(and of per-head q/k norm weights), pairs (2i, 2i + 1) -> (i, rotary_dim / 2 + i), and npu_apply_rotary_pos_emb's
rotate-half computes the architecture's rotary on them (code: parts/code/attention_fused.py ROPE_INTERLEAVED; the
cos / sin tables are parts/code/rotary.py's)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.mla import is_mla_model
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.position import ROTARY, probe_rotate_half, rope_match


ROTARY_DIM_KEY = "rotary_dim"       # gptj / codegen: the rotary dims of a head, a config key


def interleaved_form(modeling_module) -> bool:
    """The architecture's apply_rotary_pos_emb is the interleaved rotary: out[2i] = x[2i] cos a_i - x[2i+1] sin a_i,
    out[2i+1] = x[2i+1] cos a_i + x[2i] sin a_i, given cos / sin as its rotary embedding makes them (the angles
    twice, glm / ernie4_5; each angle repeated, cohere)."""
    import torch

    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 2, 3, 8, generator=gen)
    angles = torch.randn(1, 3, 4, generator=gen)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]

    def pairs(x):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)

    apply = getattr(modeling_module, "apply_rotary_pos_emb", None)
    if apply is None:
        return complex_pairs_form(modeling_module, q, k, angles, pairs)

    for table in (torch.cat((angles, angles), -1), angles.repeat_interleave(2, -1)):
        try:
            got_q, got_k = apply(q, k, table.cos(), table.sin())[:2]
        except Exception:  # noqa: BLE001 - another signature or width: not this form
            continue
        if torch.allclose(got_q, pairs(q), atol=1e-5) and torch.allclose(got_k, pairs(k), atol=1e-5):
            return True
    try:
        # gptj / codegen: apply(x, sin, cos) on one tensor [batch, seq, heads, dims], each angle once
        got_q = apply(q.transpose(1, 2), angles.sin(), angles.cos()).transpose(1, 2)
    except Exception:  # noqa: BLE001 - another signature or width: not this form
        return False
    return torch.allclose(got_q, pairs(q), atol=1e-5)


def complex_pairs_form(modeling_module, q, k, angles, pairs) -> bool:
    """llama4's apply_rotary_emb(xq, xk, freqs_cis): each pair (2i, 2i + 1) a complex number times the complex table
    e^(i a) its rotary embedding makes, on [batch, seq, heads, dims] — the interleaved rotary."""
    import torch

    apply = getattr(modeling_module, "apply_rotary_emb", None)
    if apply is None:
        return False
    try:
        got_q, got_k = apply(q.transpose(1, 2), k.transpose(1, 2), torch.polar(torch.ones_like(angles), angles))[:2]
    except Exception:  # noqa: BLE001 - another signature or width: not this form
        return False
    return torch.allclose(got_q.transpose(1, 2), pairs(q), atol=1e-5) and \
        torch.allclose(got_k.transpose(1, 2), pairs(k), atol=1e-5)


def _probe(probe, chosen):
    if is_mla_model(probe):
        return None
    try:
        probe_rotate_half(probe.modeling)
        return None                     # rotate-half: the plain rotary part's
    except NotNative:
        pass
    if not interleaved_form(probe.modeling):
        return None                     # neither form: the plain rotary part names it
    if any(hasattr(layer.self_attn, name) for layer in probe.layers for name in ("q_layernorm", "k_layernorm")):
        raise NotNative("position", "interleaved rotary with q/k LayerNorms the file does not reorder")
    if not isinstance(getattr(probe.config, "rope_parameters", None), dict) and \
            isinstance(getattr(probe.config, ROTARY_DIM_KEY, None), int):
        # gptj / codegen: no rope settings, the rotary dims of each head a config key, the base 10000
        return Match(ROTARY_INTERLEAVED, options={"ROPE_BY_LAYER_TYPE": False, "ROPE_INTERLEAVED": True,
                                                  "ROTARY_DIM": ROTARY_DIM_KEY},
                     facts={"rope_types": ("default",), "partial": True, "by_type": False})
    return rope_match(probe, ROTARY_INTERLEAVED, {"ROPE_INTERLEAVED": True})


def _variants(match, probe):
    """The rope types of the config's rope settings (none where the config has none: one rotary)."""
    return [] if match.options.get("ROTARY_DIM") else ROTARY.variants(match, probe)


ROTARY_INTERLEAVED = Part(
    slot="position", name="rotary_interleaved", code="rotary.py", provides="ModelRotaryEmbedding",
    reads=ROTARY.reads + (ROTARY_DIM_KEY,), probe=_probe, options=("ROPE_BY_LAYER_TYPE", "ROPE_INTERLEAVED", "ROTARY_DIM"),
    variants=_variants,
    kernels=lambda m: (("npu_apply_rotary_pos_emb (rotate-half) on q/k rows reordered once at load: the "
                        "architecture's interleaved pairs",), ()))
