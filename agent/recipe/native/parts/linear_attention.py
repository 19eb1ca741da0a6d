"""Linear attention beside softmax attention (a hybrid's linear_attention layers): the Gated DeltaNet of qwen3_next
and qwen3_5 (code/linear_attention_gdn.py), as upstream's models/qwen3_5 runs it. Read from the architecture: which
layers hold linear_attn (config.layer_types' linear_attention ones, held to the built model), the projections'
layout (qwen3_next's in_proj_qkvz / in_proj_ba grouped by key head, or qwen3_5's in_proj_qkv / z / b / a), and the
layer's arithmetic, checked numerically against the formula the file computes (causal depthwise conv1d + SiLU over
q/k/v, l2-normed q and k, beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), the gated delta rule from zero
state with scale D_k ** -0.5, RMSNorm of each value head times SiLU(z), out_proj)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.layout import is_kda, is_mamba2_mixer
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

LAYOUTS = {
    "qkvz_ba": {"in_proj_qkvz", "in_proj_ba", "conv1d", "norm", "out_proj"},
    "qkv_z_b_a": {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj"},
    # olmo_hybrid: q, k, v, the gate (g_proj), b and a each its own projection; o_norm, o_proj
    "q_k_v_g_b_a": {"q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj", "conv1d", "o_norm", "o_proj"},
}
KIND = "linear attention"
# the q_k_v_g_b_a layout's checkpoint names -> the file's (its q/k/v load into one merged_qkv_proj by shard)
SEPARATE_RENAMES = (("\\.linear_attn\\.g_proj\\.", ".linear_attn.in_proj_z."),
                    ("\\.linear_attn\\.b_proj\\.", ".linear_attn.in_proj_b."),
                    ("\\.linear_attn\\.a_proj\\.", ".linear_attn.in_proj_a."),
                    ("\\.linear_attn\\.o_proj\\.", ".linear_attn.out_proj."),
                    ("\\.linear_attn\\.o_norm\\.", ".linear_attn.norm."))
QKV_SHARDS = (("merged_qkv_proj", "q_proj", "q"), ("merged_qkv_proj", "k_proj", "k"), ("merged_qkv_proj", "v_proj", "v"))
CONV_SHARDS = (("conv1d", "q_conv1d", "q"), ("conv1d", "k_conv1d", "k"), ("conv1d", "v_conv1d", "v"))


def _name(pattern: str) -> str:
    return pattern.strip("^$").replace("\\.", ".")


def stored_conversion(rule) -> str | None:
    """The checkpoint layout of linear-attention tensors a transformers conversion rule describes, or None:
    "conv_q_k_v": the depthwise conv's q, k and v kernels stored apart (q_conv1d / k_conv1d / v_conv1d), which
    transformers concatenates along the channels into conv1d (olmo_hybrid; the Kimi Delta Attention of kimi_linear
    and bailing_hybrid) — the file loads each into its rows (CONV_SHARDS); "in_proj": one in_proj, rows
    [q|k|v|z|b|a], which transformers splits into in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (lara_mini) —
    the file keeps the one projection and splits its output."""
    operations = getattr(rule, "operations", None) or []
    kinds = [(type(op).__name__, getattr(op, "dim", None)) for op in operations]
    sources, targets = [_name(s) for s in rule.source_patterns], [_name(t) for t in rule.target_patterns]
    if kinds == [("Concatenate", 0)] and len(targets) == 1 and targets[0].endswith("conv1d.weight") \
            and sources == [targets[0].replace("conv1d.weight", f"{x}_conv1d.weight") for x in "qkv"]:
        return "conv_q_k_v"
    if kinds == [("Split", 0)] and len(sources) == 1 and sources[0].endswith("linear_attn.in_proj") \
            and targets == [sources[0] + suffix for suffix in ("_qkv", "_z", "_b", "_a")]:
        return "in_proj"
    return None


def refuse_recurrent_attention(probe) -> None:
    """NotNative for a recurrent layer in the attention's place (a self_attn with a depthwise conv1d and a decay)
    that the layout did not read as a linear_attn: kimi_linear's and bailing_hybrid's Kimi Delta Attention is read so
    (layout.is_kda; parts/linear_attention_kda.py writes it), another of its kind names itself here."""
    found = {}
    for index, layer in enumerate(probe.layers):
        module = getattr(layer, "self_attn", None)
        if module is None or "conv1d" not in children(module):
            continue
        decays = {name.rsplit(".", 1)[-1]: param for name, param in module.named_parameters()
                  if name.rsplit(".", 1)[-1] in ("A_log", "dt_bias")}
        if decays:
            per_channel = "dt_bias" in decays and "A_log" in decays and decays["dt_bias"].numel() > decays["A_log"].numel()
            found.setdefault((type(module).__name__, per_channel), []).append(index)
    for (name, per_channel), layers in found.items():
        kind = "a per-key-channel decay (Kimi Delta Attention), which no NPU op computes" if per_channel else \
            "a delta rule under self_attn"
        raise NotNative(KIND, f"{name} (layers {layers}): a recurrent layer in the attention's place with {kind}; "
                              "no part writes it")


def stored_layouts(model_type: str) -> set:
    """The stored_conversion layouts transformers' conversion mapping names for `model_type`."""
    from transformers import conversion_mapping

    rules = conversion_mapping.get_checkpoint_conversion_mapping(model_type) or []
    return {found for found in map(stored_conversion, rules) if found}


def _project(layer, x, layout: str):
    """(q/k/v as the conv reads them [T, 2 key_dim + value_dim], z [T, N_v, D_v], b, a [T, N_v]) of x [T, hidden]."""
    import torch

    nk, nv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    tokens = x.shape[0]
    if layout == "qkvz_ba":
        group = nv // nk
        q, k, v, z = layer.in_proj_qkvz(x).view(tokens, nk, -1).split((dk, dk, group * dv, group * dv), dim=-1)
        b, a = layer.in_proj_ba(x).view(tokens, nk, -1).split((group, group), dim=-1)
        mixed = torch.cat([t.reshape(tokens, -1) for t in (q, k, v)], dim=-1)
        return mixed, z.reshape(tokens, nv, dv), b.reshape(tokens, nv), a.reshape(tokens, nv)
    if layout == "q_k_v_g_b_a":
        return (torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], dim=-1),
                layer.g_proj(x).view(tokens, nv, dv), layer.b_proj(x), layer.a_proj(x))
    return (layer.in_proj_qkv(x), layer.in_proj_z(x).view(tokens, nv, dv), layer.in_proj_b(x), layer.in_proj_a(x))


def formula(layer, x, layout: str):
    """The file's arithmetic in plain float32 torch, on transformers' layer's weights: x [T, hidden] -> [T, hidden]."""
    import torch
    import torch.nn.functional as F

    nk, nv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    tokens, kernel = x.shape[0], layer.conv1d.weight.shape[-1]
    mixed, z, b, a = _project(layer, x, layout)
    conv = F.conv1d(mixed.t()[None], layer.conv1d.weight, padding=kernel - 1, groups=mixed.shape[-1])
    mixed = F.silu(conv[0, :, :tokens].t())
    q, k, v = mixed.split((nk * dk, nk * dk, nv * dv), dim=-1)
    q, k = (F.normalize(t.reshape(tokens, nk, dk), dim=-1, eps=1e-6).repeat_interleave(nv // nk, dim=1) for t in (q, k))
    v = v.reshape(tokens, nv, dv)
    beta, g = b.sigmoid() * beta_scale(layer), -layer.A_log.exp() * F.softplus(a + layer.dt_bias)
    state, out = torch.zeros(nv, dv, dk), torch.empty(tokens, nv, dv)
    for t in range(tokens):
        state = state * g[t].exp()[:, None, None]
        state = state + (beta[t][:, None] * (v[t] - (state @ k[t][..., None])[..., 0]))[..., None] * k[t][:, None, :]
        out[t] = (state @ (q[t] * dk ** -0.5)[..., None])[..., 0]
    norm, out_proj = (layer.o_norm, layer.o_proj) if layout == "q_k_v_g_b_a" else (layer.norm, layer.out_proj)
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight
    return out_proj((normed * F.silu(z)).reshape(tokens, nv * dv))


def beta_scale(layer) -> float:
    """2 where the layer lets beta reach 2 (olmo_hybrid's allow_neg_eigval: negative eigenvalues), else 1."""
    return 2.0 if getattr(layer, "allow_neg_eigval", False) else 1.0


def _probe(probe, chosen):
    import torch

    linear = [hasattr(layer, "linear_attn") for layer in probe.layers]
    if not any(linear) or all(is_mamba2_mixer(layer.linear_attn) for layer in probe.layers if hasattr(layer, "linear_attn")):
        return None           # a Mamba2 mixer: parts/linear_attention_mamba2.py
    if all(is_kda(layer.linear_attn) for layer in probe.layers if hasattr(layer, "linear_attn")):
        return None           # a Kimi Delta Attention: parts/linear_attention_kda.py
    types = getattr(probe.config, "layer_types", None) or []
    if [t == "linear_attention" for t in types[:len(linear)]] != linear:
        raise NotNative(KIND, f"linear_attn layers {[i for i, x in enumerate(linear) if x]} are not config.layer_types' "
                              "linear_attention ones")
    layouts = set()
    for index, layer in enumerate(probe.layers):
        if not linear[index]:
            continue
        module = layer.linear_attn
        names = set(children(module))
        layout = next((name for name, modules in LAYOUTS.items() if names == modules), None)
        if layout is None or not all(hasattr(module, p) for p in ("A_log", "dt_bias")):
            raise NotNative(KIND, f"{type(module).__name__} has {sorted(names)}: not a Gated DeltaNet the file writes")
        if module.conv1d.bias is not None or getattr(module, "activation", "silu") != "silu":
            raise NotNative(KIND, f"{type(module).__name__}: a conv bias or a {module.activation} conv activation")
        x = torch.randn(9, probe.hidden, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            got = module(x[None])
            want = formula(module, x, layout)
        got = got[0] if isinstance(got, tuple) else got
        if not torch.allclose(got[0], want, rtol=1e-4, atol=1e-5 * float(want.abs().max())):
            raise NotNative(KIND, f"{type(module).__name__} is not the gated delta rule the file computes (largest "
                                  f"difference {float((got[0] - want).abs().max()):.3g})")
        layouts.add(layout)
    if len(layouts) != 1:
        raise NotNative(KIND, "linear-attention layers of unequal layout")
    layout = layouts.pop()
    module = probe.layers[linear.index(True)].linear_attn
    stored = stored_layouts(probe.model_type)
    if "in_proj" in stored and layout != "qkv_z_b_a":
        raise NotNative(KIND, f"transformers splits a stored in_proj into {type(module).__name__}'s, whose layout is "
                              f"{layout}")
    options = {"LINEAR_ATTENTION": True, "GDN_PROJECTIONS": "in_proj" if "in_proj" in stored else layout,
               "CONV_SHARDS": "conv_q_k_v" in stored, "STACKED_PARAMS": CONV_SHARDS if "conv_q_k_v" in stored else ()}
    if layout == "q_k_v_g_b_a":
        options["STACKED_PARAMS"] += QKV_SHARDS
        options["CHECKPOINT_RENAMES"] = SEPARATE_RENAMES
    options["NEG_EIGVAL_KEY"] = _neg_eigval_key(probe, module)
    # npu_chunk_gated_delta_rule takes head widths up to 128: a wider family's prefill runs the rule in plain torch
    options["WIDE_HEADS"] = max(module.head_k_dim, module.head_v_dim) > 128
    options["GATED_NORM_EPS"] = _gated_norm_eps(probe, module, linear.index(True))
    return Match(GATED_DELTA_NET, options=options)


def _neg_eigval_key(probe, module) -> str | None:
    """The config key that lets beta reach 2 (olmo_hybrid's linear_allow_neg_eigval), or None where the layer has
    no such switch."""
    if not hasattr(module, "allow_neg_eigval"):
        return None
    key = "linear_allow_neg_eigval"
    if getattr(probe.config, key, None) != module.allow_neg_eigval:
        raise NotNative(KIND, f"{type(module).__name__}.allow_neg_eigval is not config.{key}")
    return key


def _gated_norm_eps(probe, module, index: int):
    """None where the gated norm's epsilon is config.rms_norm_eps (the file reads it), else the value the
    architecture fixes (olmo_hybrid's o_norm: 1e-5 whatever the config says), found by building the layer with
    another rms_norm_eps."""
    norm = getattr(module, "norm", None) or getattr(module, "o_norm")
    eps = getattr(probe.config, "rms_norm_eps", None)
    if eps is not None and norm.variance_epsilon != eps:
        return float(norm.variance_epsilon)
    other = probe.variant({"rms_norm_eps": (eps or 1e-6) * 7})
    moved = getattr(other.layers[index].linear_attn, "norm", None) or other.layers[index].linear_attn.o_norm
    return None if moved.variance_epsilon != norm.variance_epsilon else float(norm.variance_epsilon)


def _kernels(match):
    return (("npu_chunk_gated_delta_rule (TND, the packed prefill from zero state, bfloat16)",
             "npu_recurrent_gated_delta_rule (decode, the state in place through ssm_state_indices)",
             "npu_rms_norm (the gated RMSNorm)"),
            ("causal depthwise conv1d over q/k/v: plain torch (upstream's torch_causal_conv1d_update at decode)",
             "the gated delta rule in float32 runs: plain torch token by token (the NPU ops return bfloat16)")
            + (("the prefill's gated delta rule: plain torch token by token (heads wider than "
                "npu_chunk_gated_delta_rule's 128)",) if match.options.get("WIDE_HEADS") else ()))


GATED_DELTA_NET = Part(
    slot="linear_attention", name="gated_delta_net", code="linear_attention_gdn.py", provides="ModelGatedDeltaNet",
    reads=("layer_types", "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim",
           "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps"),
    probe=_probe, kernels=_kernels, options=("LINEAR_ATTENTION", "GDN_PROJECTIONS", "CONV_SHARDS", "NEG_EIGVAL_KEY",
                                             "GATED_NORM_EPS", "WIDE_HEADS"))
