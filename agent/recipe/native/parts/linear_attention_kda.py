"""Kimi Delta Attention beside softmax attention (kimi_linear's KimiLinearDeltaAttention, bailing_hybrid's
BailingHybridDeltaAttention: config.layer_types' linear_attention layers, stored under self_attn and read as the
layer's linear_attn by the layout, agent.recipe.native.parts.layout.is_kda), as code/linear_attention_kda.py writes
it. Read from the architecture: the forget gate's and the output gate's projections (low-rank or full), a bounded
forget gate's config keys, and the layer's arithmetic, checked numerically against the formula the file computes
(causal depthwise conv1d + SiLU over q/k/v, l2-normed q and k, beta = sigmoid(b_proj), g per key channel, the delta
rule from zero state with scale D ** -0.5, RMSNorm of each head times sigmoid of the output gate, o_proj)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.layout import is_kda
from agent.recipe.native.parts.linear_attention import CONV_SHARDS, stored_layouts
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

KIND = "linear attention"
SAFE_GATE_KEYS = ("kda_safe_gate", "kda_lower_bound")       # bailing_hybrid's bounded forget gate


def _forget_form(module) -> str | None:
    names = set(children(module.forget_gate))
    return {frozenset({"f_a_proj", "f_b_proj"}): "low_rank", frozenset({"f_proj"}): "full"}.get(frozenset(names))


def _output_form(module) -> str | None:
    names = set(children(module))
    if {"g_a_proj", "g_b_proj"} <= names and "g_proj" not in names:
        return "low_rank"
    return "full" if "g_proj" in names and not names & {"g_a_proj", "g_b_proj"} else None


def formula(module, x, forget: str, output: str, safe_gate: tuple | None):
    """The file's arithmetic in plain float32 torch on transformers' layer's weights: x [T, hidden] -> [T, hidden],
    from zero state. `safe_gate`: (lower bound) where the forget gate is bounded, else None."""
    import torch
    import torch.nn.functional as F

    tokens, kernel = x.shape[0], module.conv1d.weight.shape[-1]
    heads, dim = module.num_heads, module.head_dim
    mixed = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)
    conv = F.conv1d(mixed.t()[None], module.conv1d.weight, padding=kernel - 1, groups=mixed.shape[-1])
    q, k, v = (t.reshape(tokens, heads, dim) for t in F.silu(conv[0, :, :tokens].t()).split(heads * dim, dim=-1))
    q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    gate = module.forget_gate
    f = gate.f_b_proj(gate.f_a_proj(x)) if forget == "low_rank" else gate.f_proj(x)
    f = (f + gate.dt_bias).view(tokens, heads, dim)
    rate = gate.A_log.exp().reshape(heads, 1)
    g = safe_gate[0] * torch.sigmoid(rate * f) if safe_gate else -rate * F.softplus(f)
    beta = torch.sigmoid(module.b_proj(x))
    state, out = torch.zeros(heads, dim, dim), torch.empty(tokens, heads, dim)
    for t in range(tokens):
        state = state * g[t].exp()[..., None]
        delta = beta[t][:, None] * (v[t] - (state * k[t][..., None]).sum(-2))
        state = state + k[t][..., None] * delta[:, None, :]
        out[t] = (state * (q[t] * dim ** -0.5)[..., None]).sum(-2)
    o_gate = module.g_b_proj(module.g_a_proj(x)) if output == "low_rank" else module.g_proj(x)
    norm = module.o_norm
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight
    return module.o_proj((normed * torch.sigmoid(o_gate.view(tokens, heads, dim))).reshape(tokens, heads * dim))


def _safe_gate(probe, module):
    """(KDA_SAFE_GATE_KEY, KDA_LOWER_BOUND_KEY) where the forget gate is bounded by config keys (bailing_hybrid's),
    held to the built gate; (None, None) where it has no bound."""
    gate = module.forget_gate
    if not hasattr(gate, "safe_gate"):
        if getattr(gate, "safe_gate_lower_bound", None) is not None:
            raise NotNative(KIND, f"{type(gate).__name__}: a bounded forget gate under no config key the file reads")
        return None, None
    key, bound = SAFE_GATE_KEYS
    if getattr(probe.config, key, None) != gate.safe_gate or getattr(probe.config, bound, None) != gate.lower_bound:
        raise NotNative(KIND, f"{type(gate).__name__}'s bound is not config.{key} / config.{bound}")
    return key, bound


def _probe(probe, chosen):
    import torch

    linear = [hasattr(layer, "linear_attn") for layer in probe.layers]
    modules = [layer.linear_attn for layer, is_linear in zip(probe.layers, linear) if is_linear]
    if not modules or not all(is_kda(m) for m in modules):
        return None
    types = getattr(probe.config, "layer_types", None) or []
    if [t == "linear_attention" for t in types[:len(linear)]] != linear:
        raise NotNative(KIND, f"Kimi Delta Attention layers {[i for i, x in enumerate(linear) if x]} are not "
                              "config.layer_types' linear_attention ones")
    forms = set()
    for module in modules:
        name = type(module).__name__
        forget, output = _forget_form(module), _output_form(module)
        if forget is None or output is None or module.conv1d.bias is not None \
                or getattr(module, "activation", "silu") not in ("silu", "swish"):
            raise NotNative(KIND, f"{name}: a forget gate of {sorted(children(module.forget_gate))}, an output gate "
                                  f"of {sorted(children(module))}, a conv bias or a {getattr(module, 'activation', None)} "
                                  "conv activation: not the Kimi Delta Attention the file writes")
        safe_key, bound_key = _safe_gate(probe, module)
        bounded = (module.forget_gate.lower_bound,) if safe_key and module.forget_gate.safe_gate else None
        x = torch.randn(9, probe.hidden, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            got = module(x[None])
            want = formula(module, x, forget, output, bounded)
        got = got[0] if isinstance(got, tuple) else got
        if not torch.allclose(got[0], want, rtol=1e-4, atol=1e-5 * float(want.abs().max())):
            raise NotNative(KIND, f"{name} is not the Kimi Delta Attention the file computes (largest difference "
                                  f"{float((got[0] - want).abs().max()):.3g})")
        if module.o_norm.variance_epsilon != probe.config.rms_norm_eps:
            raise NotNative(KIND, f"{name}'s o_norm epsilon is not config.rms_norm_eps")
        forms.add((forget, output, safe_key, bound_key))
    if len(forms) != 1:
        raise NotNative(KIND, "Kimi Delta Attention layers of unequal forms")
    forget, output, safe_key, bound_key = forms.pop()
    stored = "conv_q_k_v" in stored_layouts(probe.model_type)
    return Match(KIMI_DELTA_ATTENTION, options={
        "LINEAR_ATTENTION": True, "LINEAR_ATTN_NAME": "self_attn", "KDA_FORGET_GATE": forget,
        "KDA_OUTPUT_GATE": output, "KDA_SAFE_GATE_KEY": safe_key, "KDA_LOWER_BOUND_KEY": bound_key,
        "CONV_SHARDS": stored, "STACKED_PARAMS": CONV_SHARDS if stored else ()})


def _kernels(match):
    return (("npu_rms_norm (the gated RMSNorm of each head)",),
            ("causal depthwise conv1d over q/k/v: plain torch (the Gated DeltaNet's)",
             "the delta rule with a per-key-channel decay: plain torch in float32, token by token "
             "(npu_chunk_gated_delta_rule takes one decay per head; npu_recurrent_gated_delta_rule's gk is written "
             "two ways on its page)"))


KIMI_DELTA_ATTENTION = Part(
    slot="linear_attention", name="kimi_delta_attention", code="linear_attention_kda.py",
    provides="ModelKimiDeltaAttention",
    reads=("layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "rms_norm_eps",
           *SAFE_GATE_KEYS),
    probe=_probe, kernels=_kernels,
    options=("LINEAR_ATTENTION", "LINEAR_ATTN_NAME", "KDA_FORGET_GATE", "KDA_OUTPUT_GATE", "KDA_SAFE_GATE_KEY",
             "KDA_LOWER_BOUND_KEY", "CONV_SHARDS"))
