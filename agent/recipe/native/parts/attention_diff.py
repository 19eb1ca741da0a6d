"""Differential attention (diffllama's DiffLlamaAttention): two softmax maps' outputs over the value halves,
subtracted with a learned lambda, an RMS norm per pair of heads and a (1 - lambda_init) scale (code
parts/code/attention_diff.py: two fused attention calls on the paged cache, the combination in plain torch). The
probe holds the first attention layer's output to that arithmetic on random lambdas, and every layer's lambda_init
and its norm to the formula the file writes."""

from __future__ import annotations

import math

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts import attention
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
DIFF_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj", "rotary_fn", "groupnorm"}


def lambda_init(layer_idx: int) -> float:
    """The file's lambda_init of layer `layer_idx` (transformers' lambda_init_fn)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def differential_output(module, x, cos, sin, mask, rotate, layer_idx: int):
    """What the file computes for a differential attention `module` on x [1, T, hidden] (plain torch, eager
    attention): the reference the probe holds transformers' forward to. `rotate(q, k, cos, sin)` is the
    architecture's rotary."""
    import torch

    heads, head_dim = module.q_proj.out_features // module.head_dim, module.head_dim
    kv_heads = module.k_proj.out_features // head_dim
    groups, half_kv, tokens = heads // kv_heads, kv_heads // 2, x.shape[1]
    q = module.q_proj(x).view(1, tokens, heads, head_dim).transpose(1, 2)
    k = module.k_proj(x).view(1, tokens, kv_heads, head_dim).transpose(1, 2)
    v = module.v_proj(x).view(1, tokens, kv_heads, head_dim).transpose(1, 2)
    q, k = rotate(q, k, cos, sin)
    weights = (q @ k.repeat_interleave(groups, dim=1).transpose(-1, -2) * head_dim ** -0.5 + mask).softmax(-1)
    value_a = torch.cat([v[:, :half_kv], v[:, :half_kv]], dim=1).repeat_interleave(groups, dim=1)
    value_b = torch.cat([v[:, half_kv:], v[:, half_kv:]], dim=1).repeat_interleave(groups, dim=1)
    both = torch.cat([weights @ value_a, weights @ value_b], dim=-1)          # [1, heads, T, 2 x head_dim]
    first, second = both[:, :heads // 2], both[:, heads // 2:]
    lam = (torch.exp((module.lambda_q1 * module.lambda_k1).sum()) - torch.exp((module.lambda_q2 * module.lambda_k2).sum())
           + lambda_init(layer_idx))
    out = (1 - lambda_init(layer_idx)) * torch.nn.functional.rms_norm(first - lam * second, (2 * head_dim,),
                                                                       eps=module.groupnorm.eps)
    return module.o_proj(out.transpose(1, 2).reshape(1, tokens, heads * head_dim))


def is_differential(probe) -> bool:
    layers = attention.attention_layers(probe)
    return bool(layers) and all(hasattr(probe.layers[i].self_attn, name) for i in layers for name in LAMBDAS)


def check_differential(probe) -> None:
    """NotNative unless every attention layer is the differential form the file writes."""
    import torch

    config, heads, kv_heads, head_dim = probe.config, probe.heads, probe.kv_heads, probe.head_dim
    if kv_heads % 2 or heads % kv_heads:
        raise NotNative("attention", f"differential attention with {kv_heads} key heads: not an even count")
    for index in attention.attention_layers(probe):
        module = probe.layers[index].self_attn
        a = children(module)
        if set(a) - DIFF_CHILDREN or "q_proj" not in a:
            raise NotNative("attention", f"{type(module).__name__} has {sorted(set(a) - DIFF_CHILDREN)} besides the "
                                         "differential attention's")
        projections = [a["q_proj"], a["k_proj"], a["v_proj"], a["o_proj"]]
        if not all(isinstance(p, torch.nn.Linear) for p in projections) or (
                a["q_proj"].out_features, a["k_proj"].out_features) != (heads * head_dim, kv_heads * head_dim):
            raise NotNative("attention", "differential attention's q/k/v/o are not the config's heads' linears")
        norm = a["groupnorm"]
        if not isinstance(norm, torch.nn.RMSNorm) or norm.weight is not None or \
                norm.normalized_shape != (2 * head_dim,) or norm.eps != config.rms_norm_eps:
            raise NotNative("attention", "differential attention's groupnorm is not a weightless RMS norm over 2 x "
                                         "head_dim with config.rms_norm_eps")
        if not math.isclose(getattr(module, "lambda_init", float("nan")), lambda_init(index), rel_tol=1e-9):
            raise NotNative("attention", f"layer {index}'s lambda_init is not 0.8 - 0.6 exp(-0.3 x layer)")
        if not math.isclose(getattr(module, "scaling", head_dim ** -0.5), head_dim ** -0.5, rel_tol=1e-6):
            raise NotNative("attention", "differential attention's softmax scale is not head_dim ** -0.5")
    _check_arithmetic(probe)


def _check_arithmetic(probe) -> None:
    """The first attention layer's output on 5 tokens (random lambdas, the rotary of positions 0..4, causal) is
    differential_output's."""
    import torch

    index = attention.attention_layers(probe)[0]
    module = probe.layers[index].self_attn
    rotate = getattr(probe.modeling, "apply_rotary_pos_emb", None)
    rotary = getattr(probe.base, "rotary_emb", None)
    if rotate is None or rotary is None:
        raise NotNative("attention", "differential attention without the rotary the file writes")
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(1, 5, probe.hidden, generator=gen)
    cos, sin = rotary(x, torch.arange(5)[None])
    mask = torch.full((5, 5), float("-inf")).triu(1)[None, None]
    saved = [getattr(module, name).detach().clone() for name in LAMBDAS]
    try:
        with torch.no_grad():
            for name in LAMBDAS:
                getattr(module, name).copy_(0.3 * torch.randn(probe.head_dim, generator=gen))
            got = module(hidden_states=x, position_embeddings=(cos, sin), attention_mask=mask)
            want = differential_output(module, x, cos, sin, mask, rotate, index)
    except Exception as exc:  # noqa: BLE001 - another call shape: not the form the file writes
        raise NotNative("attention", f"differential attention: its forward ({type(exc).__name__}) is not the "
                                     "known form") from exc
    finally:
        with torch.no_grad():
            for name, value in zip(LAMBDAS, saved):
                getattr(module, name).copy_(value)
    got = got[0] if isinstance(got, (tuple, list)) else got
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise NotNative("attention", "differential attention's output is not (A1 - lambda A2) normed per pair of "
                                     "heads, scaled by 1 - lambda_init")


def _diff_paged(probe, chosen):
    if not is_differential(probe):
        return None
    check_differential(probe)
    position = chosen.get("position")
    if position is None or not position.options.get("ROTARY", True) or position.options.get("ALIBI") \
            or position.options.get("ABSOLUTE_POSITIONS"):
        raise NotNative("attention", "differential attention without a rotary position part")
    if attention.windows(probe)["WINDOWS"]:
        raise NotNative("attention", "differential attention with sliding-window layers: not written")
    qkv, o = attention._projections(probe)
    options = {"QKV": "merged_qkv_proj", "QKV_BIAS": attention._bias_option(probe, qkv[0].bias is not None, "qkv"),
               "O_BIAS": attention._bias_option(probe, o.bias is not None, "o"),
               "STACKED_PARAMS": (("merged_qkv_proj", "q_proj", "q"), ("merged_qkv_proj", "k_proj", "k"),
                                  ("merged_qkv_proj", "v_proj", "v"))}
    return Match(DIFF_PAGED, options=options, facts={"partial": bool(position.facts.get("partial")), "sinks": False})


def _kernels(match):
    return (attention.WRITE_KERNELS + (attention._rope_kernel(match),
                                       "npu_fused_infer_attention_score_v2 x2 (TND, paged cache through block_table: "
                                       "the value cache and the swapped-halves value cache)"),
            ("differential attention's combination (A1 - lambda A2, the weightless RMS norm per pair of heads, "
             "1 - lambda_init): plain torch",))


DIFF_PAGED = Part(
    slot="attention", name="diff_paged", code="attention_diff.py", provides="ModelDiffAttention",
    reads=("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "attention_bias", "rms_norm_eps"),
    probe=_diff_paged, kernels=_kernels, options=("QKV", "QKV_BIAS", "O_BIAS", "STACKED_PARAMS"),
    variants=attention._variants)
