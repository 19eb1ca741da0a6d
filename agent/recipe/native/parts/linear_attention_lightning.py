"""MiniMax's lightning attention on config.layer_types' linear_attention layers (transformers' MiniMaxLightningAttention,
held as self_attn beside the softmax attention's layers; the layout reads it as the file's linear_attn:
parts/layout.py's is_lightning), written as code/linear_attention_lightning.py. Read from the architecture: which
layers hold it (held to config.layer_types), its activation (config.hidden_act's), its norm's epsilon (fixed by the
architecture, found by building it with another rms_norm_eps) and its arithmetic, checked numerically on each layer
against the formula the file computes: act(qkv_proj(x)) into each head's [q | k | v]; o_i = sum_(j <= i)
e^(-slope (i - j)) (q_i . k_j) v_j, the slope per head 2^(-8 (h + 1) / H) scaled by the layer's depth; RMSNorm over all
heads; sigmoid(output_gate(x)) times it; out_proj. A decay not scaled by the layer fails on any layer but the first."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.layout import is_lightning
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

KIND = "linear attention"
LAYER_TYPE = "linear_attention"


def slopes(heads: int, layer: int, layers: int):
    """The file's decay per head and token (code/linear_attention_lightning.py's lightning_slopes)."""
    import torch

    base = 1 / (2 ** (8 / heads))
    return (torch.tensor(base, dtype=torch.float32) ** (torch.arange(heads) + 1)) * (1 - layer / (layers - 1 + 1e-5) + 1e-5)


def formula(module, x, layer: int, layers: int, act, eps: float):
    """The file's arithmetic in plain float32 torch on transformers' module's weights: x [T, hidden] -> [T, hidden]."""
    import torch

    heads = module.num_attention_heads
    tokens, dim = x.shape[0], module.qkv_proj.weight.shape[0] // (3 * heads)
    q, k, v = act(module.qkv_proj(x)).view(tokens, heads, 3 * dim).transpose(0, 1).split(dim, dim=-1)
    index = torch.arange(tokens, dtype=torch.float32)
    gap = index[:, None] - index[None, :]
    decay = slopes(heads, layer, layers)[:, None, None]
    weights = torch.where(gap >= 0, torch.exp(-decay * gap.clamp_min(0)), torch.zeros(()))
    out = (((q @ k.transpose(-1, -2)) * weights) @ v).transpose(0, 1).reshape(tokens, heads * dim)
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps) * module.norm.weight
    return module.out_proj(torch.sigmoid(module.output_gate(x)) * normed)


def _norm_eps(probe, index: int) -> float:
    """The norm's epsilon, which the architecture fixes (MiniMaxRMSNorm's default 1e-6 whatever the config says)."""
    eps = float(probe.layers[index].linear_attn.norm.variance_epsilon)
    other = probe.variant({"rms_norm_eps": (getattr(probe.config, "rms_norm_eps", None) or 1e-6) * 7})
    if float(other.layers[index].linear_attn.norm.variance_epsilon) != eps:
        raise NotNative(KIND, "the lightning attention's norm epsilon follows config.rms_norm_eps, which the file "
                              "does not read")
    return eps


def _probe(probe, chosen):
    import torch
    from transformers.activations import ACT2FN

    mixers = [getattr(layer, "linear_attn", None) for layer in probe.layers]
    if not any(m is not None and is_lightning(m) for m in mixers):
        return None
    linear = [m is not None for m in mixers]
    types = getattr(probe.config, "layer_types", None) or []
    if [t == LAYER_TYPE for t in types[:len(linear)]] != linear:
        raise NotNative(KIND, f"lightning-attention layers {[i for i, x in enumerate(linear) if x]} are not "
                              f"config.layer_types' {LAYER_TYPE} ones")
    act = ACT2FN[probe.config.hidden_act]
    first = linear.index(True)
    eps = _norm_eps(probe, first)
    for index, module in enumerate(mixers):
        if module is None:
            continue
        name = type(module).__name__
        if not is_lightning(module) or any(getattr(children(module)[p], "bias", None) is not None
                                           for p in ("qkv_proj", "output_gate", "out_proj")):
            raise NotNative(KIND, f"{name} has {sorted(children(module))}: not the lightning attention the file writes")
        if type(module.act_fn) is not type(act):
            raise NotNative(KIND, f"{name}'s activation {type(module.act_fn).__name__} is not config.hidden_act's")
        x = torch.randn(11, probe.hidden, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            got = module(x[None], position_embeddings=None, attention_mask=None)
            want = formula(module, x, index, probe.config.num_hidden_layers, act, eps)
        got = got[0] if isinstance(got, tuple) else got
        if not torch.allclose(got[0], want, rtol=1e-4, atol=1e-5 * float(want.abs().max())):
            raise NotNative(KIND, f"layer {index}: {name} is not the decayed linear attention the file computes "
                                  f"(largest difference {float((got[0] - want).abs().max()):.3g})")
    return Match(LIGHTNING, options={"LINEAR_ATTENTION": True, "LINEAR_LAYER_TYPE": LAYER_TYPE,
                                     "LIGHTNING_NORM_EPS": eps})


def _kernels(match):
    return (("npu_rms_norm (the norm over all heads' width)",),
            ("the decayed linear attention (per-head slope_rate, scaled by layer): plain torch in float32, the "
             "prefill block by block in its causal form, the decode step on the request's state (no NPU op computes "
             "it)", "sigmoid(output_gate) times the normed output: plain torch"))


LIGHTNING = Part(
    slot="linear_attention", name="lightning", code="linear_attention_lightning.py",
    provides="ModelLightningAttention",
    reads=("layer_types", "num_attention_heads", "head_dim", "hidden_size", "hidden_act", "num_hidden_layers"),
    probe=_probe, kernels=_kernels, options=("LINEAR_ATTENTION", "LINEAR_LAYER_TYPE", "LIGHTNING_NORM_EPS"))
