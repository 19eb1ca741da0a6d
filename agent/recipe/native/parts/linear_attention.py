"""Linear attention beside softmax attention (a hybrid's linear_attention layers): the Gated DeltaNet of qwen3_next
and qwen3_5 (code/linear_attention_gdn.py), as upstream's models/qwen3_5 runs it. Read from the architecture: which
layers hold linear_attn (config.layer_types' linear_attention ones, held to the built model), the projections'
layout (qwen3_next's in_proj_qkvz / in_proj_ba grouped by key head, or qwen3_5's in_proj_qkv / z / b / a), and the
layer's arithmetic, checked numerically against the formula the file computes (causal depthwise conv1d + SiLU over
q/k/v, l2-normed q and k, beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), the gated delta rule from zero
state with scale D_k ** -0.5, RMSNorm of each value head times SiLU(z), out_proj)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

LAYOUTS = {
    "qkvz_ba": {"in_proj_qkvz", "in_proj_ba", "conv1d", "norm", "out_proj"},
    "qkv_z_b_a": {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj"},
}
KIND = "linear attention"


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
    beta, g = b.sigmoid(), -layer.A_log.exp() * F.softplus(a + layer.dt_bias)
    state, out = torch.zeros(nv, dv, dk), torch.empty(tokens, nv, dv)
    for t in range(tokens):
        state = state * g[t].exp()[:, None, None]
        state = state + (beta[t][:, None] * (v[t] - (state @ k[t][..., None])[..., 0]))[..., None] * k[t][:, None, :]
        out[t] = (state @ (q[t] * dk ** -0.5)[..., None])[..., 0]
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + layer.norm.variance_epsilon) * layer.norm.weight
    return layer.out_proj((normed * F.silu(z)).reshape(tokens, nv * dv))


def _probe(probe, chosen):
    import torch

    linear = [hasattr(layer, "linear_attn") for layer in probe.layers]
    if not any(linear):
        return None
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
    return Match(GATED_DELTA_NET, options={"LINEAR_ATTENTION": True, "GDN_PROJECTIONS": layouts.pop()})


def _kernels(match):
    return (("npu_chunk_gated_delta_rule (TND, the packed prefill from zero state, bfloat16)",
             "npu_recurrent_gated_delta_rule (decode, the state in place through ssm_state_indices)",
             "npu_rms_norm (the gated RMSNorm)"),
            ("causal depthwise conv1d over q/k/v: plain torch (upstream's torch_causal_conv1d_update at decode)",
             "the gated delta rule in float32 runs: plain torch token by token (the NPU ops return bfloat16)"))


GATED_DELTA_NET = Part(
    slot="linear_attention", name="gated_delta_net", code="linear_attention_gdn.py", provides="ModelGatedDeltaNet",
    reads=("layer_types", "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim",
           "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps"),
    probe=_probe, kernels=_kernels, options=("LINEAR_ATTENTION", "GDN_PROJECTIONS"))
