"""The Mamba1 mixer (jamba's mamba layers beside attention; mamba's and falcon_mamba's mixers), as
code/linear_attention_mamba1.py writes it. Read from the architecture: which layers hold it (config.layer_types'
linear_attention ones, held to the built model; the layer's mixer is read as the file's linear_attn by the layout,
agent.recipe.native.parts.layout), the config keys of its sizes (jamba's mamba_d_state ..., mamba's state_size ...,
each held to the built mixer's own sizes), its RMSNorms of dt / B / C (with weights, without, or none) and its
arithmetic, checked numerically against the formula the file computes (in_proj into [x | gate], causal depthwise
conv1d + SiLU over x, x_proj into [dt | B | C], their norms, dt = softplus(dt_proj(dt)), h = exp(dt A) h + dt x B^T
per channel from zero state, y = (h C + D x) silu(gate), out_proj)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.layout import is_mamba1_mixer
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

KIND = "linear attention"
CHILDREN = {"in_proj", "conv1d", "x_proj", "dt_proj", "out_proj", "act"}
NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")
# each family's config keys of the mixer's sizes (the code's options), tried in order: the one whose values are the
# built mixer's
KEYS = {
    "jamba": {"MAMBA1_STATE_KEY": "mamba_d_state", "MAMBA1_CONV_KEY": "mamba_d_conv",
              "MAMBA1_DT_RANK_KEY": "mamba_dt_rank", "MAMBA1_CONV_BIAS_KEY": "mamba_conv_bias",
              "MAMBA1_PROJ_BIAS_KEY": "mamba_proj_bias", "MAMBA1_INNER_KEY": None},
    "mamba": {"MAMBA1_STATE_KEY": "state_size", "MAMBA1_CONV_KEY": "conv_kernel",
              "MAMBA1_DT_RANK_KEY": "time_step_rank", "MAMBA1_CONV_BIAS_KEY": "use_conv_bias",
              "MAMBA1_PROJ_BIAS_KEY": "use_bias", "MAMBA1_INNER_KEY": "intermediate_size"},
}
NORM_EPS_KEYS = ("mixer_rms_eps", "rms_norm_eps")


def _rms(x, eps, weight=None):
    import torch

    x = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return x if weight is None else weight.float() * x


def formula(module, x, norm, eps):
    """The file's arithmetic in plain float32 torch on transformers' mixer's weights: x [T, hidden] -> [T, hidden],
    from zero state. `norm`: the code's MAMBA1_DT_BC_NORM."""
    import torch
    import torch.nn.functional as F

    tokens, kernel = x.shape[0], module.conv1d.weight.shape[-1]
    rank, state_size = module.dt_proj.weight.shape[1], module.A_log.shape[1]
    mixed, gate = module.in_proj(x).chunk(2, dim=-1)
    conv = F.conv1d(mixed.t()[None], module.conv1d.weight, module.conv1d.bias, padding=kernel - 1,
                    groups=mixed.shape[-1])
    xs = F.silu(conv[0, :, :tokens].t())
    dt, B, C = module.x_proj(xs).split((rank, state_size, state_size), dim=-1)
    if norm is not None:
        weights = [getattr(module, n).weight if norm == "weighted" else None for n in NORMS]
        dt, B, C = (_rms(t, eps, w) for t, w in zip((dt, B, C), weights))
    dt = F.softplus(dt @ module.dt_proj.weight.t() + module.dt_proj.bias)
    A = -module.A_log.exp()
    state, out = torch.zeros(A.shape), torch.empty(xs.shape)
    for t in range(tokens):
        state = state * (dt[t][:, None] * A).exp() + (dt[t] * xs[t])[:, None] * B[t][None, :]
        out[t] = state @ C[t] + module.D * xs[t]
    return module.out_proj(out * F.silu(gate))


def _keys(config, module):
    """The family's config keys whose values are `module`'s sizes; NotNative where none are."""
    sizes = (module.A_log.shape[1], module.conv1d.weight.shape[-1], module.dt_proj.weight.shape[1],
             module.conv1d.bias is not None, getattr(module.in_proj, "bias", None) is not None)
    names = ("MAMBA1_STATE_KEY", "MAMBA1_CONV_KEY", "MAMBA1_DT_RANK_KEY", "MAMBA1_CONV_BIAS_KEY",
             "MAMBA1_PROJ_BIAS_KEY")
    inner = module.A_log.shape[0]
    for keys in KEYS.values():
        values = tuple(getattr(config, keys[name], None) for name in names)
        if None in values:
            continue
        read_inner = getattr(config, keys["MAMBA1_INNER_KEY"], None) if keys["MAMBA1_INNER_KEY"] else \
            int(getattr(config, "mamba_expand", 0) * config.hidden_size)
        if tuple(int(v) if not isinstance(v, bool) else v for v in values[:3]) + tuple(map(bool, values[3:])) \
                == sizes and read_inner == inner:
            return keys
    raise NotNative(KIND, f"{type(module).__name__}: no config keys the file reads give its sizes (state {sizes[0]}, "
                          f"conv {sizes[1]}, dt rank {sizes[2]}, inner {inner})")


def _norm(config, module):
    """(MAMBA1_DT_BC_NORM, its epsilon key) from the mixer's dt / B / C norms."""
    import torch

    present = [n for n in NORMS if hasattr(module, n)]
    if not present:
        return None, "rms_norm_eps"
    if len(present) != len(NORMS):
        raise NotNative(KIND, f"{type(module).__name__}: {present} of the dt / B / C norms, not all three")
    weighted = [isinstance(getattr(getattr(module, n), "weight", None), torch.nn.Parameter) for n in NORMS]
    if len(set(weighted)) != 1:
        raise NotNative(KIND, f"{type(module).__name__}: some dt / B / C norms with weights, some without")
    eps = {getattr(getattr(module, n), "variance_epsilon", getattr(getattr(module, n), "eps", None)) for n in NORMS}
    key = next((k for k in NORM_EPS_KEYS if len(eps) == 1 and getattr(config, k, None) == next(iter(eps))), None)
    if key is None:
        raise NotNative(KIND, f"{type(module).__name__}: no config key holds its dt / B / C norms' epsilon {eps}")
    return ("weighted" if weighted[0] else "weightless"), key


def _probe(probe, chosen):
    import torch

    linear = [hasattr(layer, "linear_attn") for layer in probe.layers]
    if not any(linear):
        return None
    modules = [layer.linear_attn for layer, is_linear in zip(probe.layers, linear) if is_linear]
    if not all(is_mamba1_mixer(m) for m in modules):
        return None                       # the Mamba2 mixer's or the Gated DeltaNet's
    both = [index for index, layer in enumerate(probe.layers) if hasattr(layer, "self_attn") and linear[index]]
    if both:
        raise NotNative("decoder layer", f"layers {both} run a Mamba1 mixer beside self_attn: no part writes a "
                                         "layer of both")
    types = getattr(probe.config, "layer_types", None) or []
    if [t == "linear_attention" for t in types[:len(linear)]] != linear:
        raise NotNative(KIND, f"Mamba1 layers {[i for i, x in enumerate(linear) if x]} are not config.layer_types' "
                              "linear_attention ones")
    options = None
    for module in modules:
        name = type(module).__name__
        extra = set(children(module)) - CHILDREN - set(NORMS)
        if extra or getattr(module, "activation", "silu") not in ("silu", "swish"):
            raise NotNative(KIND, f"{name}: {sorted(extra)} beside the Mamba1 mixer's children, or a "
                                  f"{getattr(module, 'activation', None)} conv activation")
        norm, eps_key = _norm(probe.config, module)
        found = {**_keys(probe.config, module), "MAMBA1_DT_BC_NORM": norm, "MAMBA1_DT_BC_NORM_EPS": eps_key}
        if options is not None and found != options:
            raise NotNative(KIND, f"{name}: its layers' mixers differ ({options} and {found})")
        options = found
        x = torch.randn(11, probe.hidden, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            got = module(x[None])
            want = formula(module, x, norm, getattr(probe.config, eps_key, None))
        got = got[0] if isinstance(got, tuple) else got
        if not torch.allclose(got[0], want, rtol=1e-4, atol=1e-5 * float(want.abs().max())):
            raise NotNative(KIND, f"{name} is not the Mamba1 selective scan the file computes (largest difference "
                                  f"{float((got[0] - want).abs().max()):.3g})")
    return Match(MAMBA1, options={"LINEAR_ATTENTION": True, **options})


def _kernels(match):
    return ((), ("in_proj / out_proj: the parallel linears (replicated: attn_tp_size 1)",
                 "causal depthwise conv1d and the Mamba1 selective scan: plain torch in float32, token by token "
                 "(no NPU op in upstream's models computes them)"))


MAMBA1 = Part(
    slot="linear_attention", name="mamba1", code="linear_attention_mamba1.py", provides="ModelMamba1Mixer",
    reads=("layer_types", "mamba_d_state", "mamba_d_conv", "mamba_dt_rank", "mamba_conv_bias", "mamba_proj_bias",
           "mamba_expand", "state_size", "conv_kernel", "time_step_rank", "use_conv_bias", "use_bias",
           "intermediate_size", "rms_norm_eps", "mixer_rms_eps"),
    probe=_probe, kernels=_kernels,
    options=("LINEAR_ATTENTION", "MAMBA1_STATE_KEY", "MAMBA1_CONV_KEY", "MAMBA1_DT_RANK_KEY", "MAMBA1_CONV_BIAS_KEY",
             "MAMBA1_PROJ_BIAS_KEY", "MAMBA1_INNER_KEY", "MAMBA1_DT_BC_NORM", "MAMBA1_DT_BC_NORM_EPS"))
