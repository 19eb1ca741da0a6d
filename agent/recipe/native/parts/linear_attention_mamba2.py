"""The Mamba2 mixer beside softmax attention (a hybrid's linear_attention layers: bamba's, granitemoehybrid's mamba),
as code/linear_attention_mamba2.py writes it. Read from the architecture: which layers hold it (config.layer_types'
linear_attention ones, held to the built model; the layer's `mamba` child is read as the file's linear_attn by the
layout, agent.recipe.native.parts.layout), its children (in_proj, a depthwise conv1d, a gated norm, out_proj; A_log,
D and dt_bias), and its arithmetic, checked numerically against the formula the file computes (in_proj into
[gate | x B C | dt], causal depthwise conv1d + SiLU over x B C, dt = softplus(dt + dt_bias) clamped to
time_step_limit, h = exp(dt A) h + dt x B^T from zero state, y = h C + D x, RMSNorm of y silu(gate) over each of
n_groups groups or the whole width, out_proj). falcon_h1's mixer besides: its input times config.ssm_in_multiplier and
in_proj's [gate | x | B | C | dt] each times its entry of config.ssm_multipliers (read on a config with them moved
off 1), and the gated norm switched by config.mamba_rms_norm (off: y silu(gate) alone), each a family setting the
self-check runs; every layer a mixer beside an attention is the parallel hybrid layer's (parts/block_parallel_hybrid.py)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.layout import is_mamba2_mixer
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

KIND = "linear attention"
# the code's defaults (bamba's keys): an option the composition sets only where the architecture's key differs
DEFAULT_KEYS = {"MAMBA_HEADS": "mamba_n_heads", "MAMBA_HEAD_DIM": "mamba_d_head", "MAMBA_GROUPS": "mamba_n_groups",
                "MAMBA_STATE": "mamba_d_state", "MAMBA_CONV": "mamba_d_conv", "MAMBA_EXPAND": "mamba_expand",
                "MAMBA_CONV_BIAS": "mamba_conv_bias", "MAMBA_PROJ_BIAS": "mamba_proj_bias", "MAMBA_DT_MIN": None}
CHILDREN = {"in_proj", "conv1d", "norm", "out_proj", "act"}


def is_linear_beside_attention(layer) -> bool:
    return hasattr(layer, "linear_attn") and hasattr(layer, "self_attn")


def formula(module, x, grouped: bool, multipliers=None, norm: bool = True):
    """The file's arithmetic in plain float32 torch on transformers' mixer's weights: x [T, hidden] -> [T, hidden],
    from zero state. `multipliers`: (ssm_in, [gate, x, B, C, dt]) (falcon_h1's); `norm` False: y * silu(gate) alone."""
    import torch
    import torch.nn.functional as F

    heads, head_dim, state_size = module.num_heads, module.head_dim, module.ssm_state_size
    groups, inner = module.n_groups, module.intermediate_size
    tokens, kernel = x.shape[0], module.conv1d.weight.shape[-1]
    if multipliers is not None:
        x = x * multipliers[0]
    gate, mixed, dt = module.in_proj(x).split((inner, inner + 2 * groups * state_size, heads), dim=-1)
    if multipliers is not None:
        gate_m, x_m, b_m, c_m, dt_m = multipliers[1]
        gate, dt = gate * gate_m, dt * dt_m
        mixed = mixed * torch.cat([torch.full((width,), float(value)) for width, value in (
            (inner, x_m), (groups * state_size, b_m), (groups * state_size, c_m))])
    conv = F.conv1d(mixed.t()[None], module.conv1d.weight, module.conv1d.bias, padding=kernel - 1,
                    groups=mixed.shape[-1])
    mixed = F.silu(conv[0, :, :tokens].t())
    xs, B, C = mixed.split((inner, groups * state_size, groups * state_size), dim=-1)
    B, C = (t.reshape(tokens, groups, state_size).repeat_interleave(heads // groups, dim=1) for t in (B, C))
    limit = tuple(getattr(module, "time_step_limit", None) or (0.0, float("inf")))
    dt = F.softplus(dt + module.dt_bias).clamp(*limit)
    A, xs = -module.A_log.exp(), xs.reshape(tokens, heads, head_dim)
    state, out = torch.zeros(heads, head_dim, state_size), torch.empty(tokens, heads, head_dim)
    for t in range(tokens):
        state = state * (dt[t] * A).exp()[:, None, None] + (dt[t][:, None] * xs[t])[..., None] * B[t][:, None, :]
        out[t] = (state @ C[t][..., None])[..., 0] + module.D[:, None] * xs[t]
    y = out.reshape(tokens, inner) * F.silu(gate)
    if not norm:
        return module.out_proj(y)
    width = inner // groups if grouped else inner
    pieces = y.view(tokens, -1, width)
    normed = pieces * torch.rsqrt(pieces.pow(2).mean(-1, keepdim=True) + module.norm.variance_epsilon)
    return module.out_proj(module.norm.weight * normed.view(tokens, inner))


# each size's config key, candidates in order (bamba's, nemotron_h's, mamba2's), held to the built mixer: the key
# whose change changes what the mixer reads
KEYS = {
    "MAMBA_HEADS": (("mamba_n_heads", "mamba_num_heads", "num_heads"), lambda m: m.num_heads),
    "MAMBA_HEAD_DIM": (("mamba_d_head", "mamba_head_dim", "head_dim"), lambda m: m.head_dim),
    "MAMBA_GROUPS": (("mamba_n_groups", "n_groups"), lambda m: m.n_groups),
    "MAMBA_STATE": (("mamba_d_state", "ssm_state_size", "state_size"), lambda m: m.ssm_state_size),
    "MAMBA_CONV": (("mamba_d_conv", "conv_kernel"), lambda m: m.conv1d.weight.shape[-1]),
    "MAMBA_EXPAND": (("mamba_expand", "expand"), lambda m: m.intermediate_size),
    "MAMBA_CONV_BIAS": (("mamba_conv_bias", "use_conv_bias"), lambda m: m.conv1d.bias is not None),
    "MAMBA_PROJ_BIAS": (("mamba_proj_bias", "use_bias"), lambda m: m.in_proj.bias is not None),
    "MAMBA_DT_MIN": (("time_step_min",), lambda m: tuple(m.time_step_limit)),
}


def _changed(value):
    return (not value) if isinstance(value, bool) else value * 2 if isinstance(value, int) else value + 0.125


def _rebuilt(module, config, index: int, key: str):
    """`module`'s class built on `config` with `key` changed; None where it does not build so."""
    import copy

    changed = copy.deepcopy(config)
    try:
        setattr(changed, key, _changed(getattr(config, key)))
        return type(module)(changed, layer_idx=index)
    except Exception:  # noqa: BLE001 - a size the mixer refuses: this key is not read alone
        return None


def mixer_keys(module, config, index: int) -> dict:
    """option -> the config key the mixer reads for it (KEYS), each found by building the mixer with the key
    changed; NotNative where no candidate controls a size the file must read."""
    found = {}
    for option, (candidates, read) in KEYS.items():
        found[option] = None
        for key in candidates:
            if not isinstance(getattr(config, key, None), (bool, int, float)):
                continue
            rebuilt = _rebuilt(module, config, index, key)
            if rebuilt is not None and read(rebuilt) != read(module):
                found[option] = key
                break
        if found[option] is None and option not in ("MAMBA_EXPAND", "MAMBA_DT_MIN"):
            raise NotNative(KIND, f"{type(module).__name__}: no config key of {', '.join(candidates)} sets its "
                                  f"{option.lower().replace('mamba_', '').replace('_', ' ')}")
    if found["MAMBA_EXPAND"] is None and module.intermediate_size != module.num_heads * module.head_dim:
        raise NotNative(KIND, f"{type(module).__name__}: an inner width {module.intermediate_size} neither expand x "
                              "hidden nor heads x head_dim")
    if found["MAMBA_DT_MIN"] is not None and tuple(getattr(config, "time_step_limit", None) or ()) == \
            tuple(module.time_step_limit):
        found["MAMBA_DT_MIN"] = None               # dt clamped to config.time_step_limit (bamba's)
    return found


def _probe(probe, chosen):
    import torch

    linear = [hasattr(layer, "linear_attn") for layer in probe.layers]
    if not any(linear):
        return None
    modules = [layer.linear_attn for layer, is_linear in zip(probe.layers, linear) if is_linear]
    if not all(is_mamba2_mixer(m) for m in modules):
        return None                       # the Gated DeltaNet's (parts/linear_attention.py)
    both = [index for index, layer in enumerate(probe.layers) if is_linear_beside_attention(layer)]
    # every layer a mixer beside an attention: the parallel hybrid layer's (parts/block_parallel_hybrid.py)
    parallel = len(both) == len(probe.layers)
    if both and not parallel:
        raise NotNative("decoder layer", f"layers {both} run a Mamba2 mixer beside self_attn, the others not: no part "
                                         "writes both")
    types = getattr(probe.config, "layer_types", None) or []
    if not parallel and [t == "linear_attention" for t in types[:len(linear)]] != linear:
        raise NotNative(KIND, f"Mamba2 layers {[i for i, x in enumerate(linear) if x]} are not config.layer_types' "
                              "linear_attention ones")
    grouped = set()
    index = next(i for i, is_linear in enumerate(linear) if is_linear)
    keys = mixer_keys(modules[0], probe.config, index)
    norm_key = norm_switch(probe, index)          # first: the norm before the gate refused in its own words
    multiplied = mixer_multipliers(probe, index)
    norm = not norm_key or bool(getattr(probe.config, norm_key))
    for module in modules:
        name = type(module).__name__
        extra = set(children(module)) - CHILDREN
        if extra or getattr(module, "activation", "silu") not in ("silu", "swish"):
            raise NotNative(KIND, f"{name}: {sorted(extra)} beside the Mamba2 mixer's children, or a "
                                  f"{getattr(module, 'activation', None)} conv activation")
        # transformers 5.0's torch path norms the gated output over the whole width, later ones per group
        grouped.add(getattr(module.norm, "group_size", module.intermediate_size) != module.intermediate_size
                    or module.n_groups == 1)
        x = torch.randn(11, probe.hidden, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            got = module(x[None])
            want = formula(module, x, grouped=min(grouped), norm=norm,
                           multipliers=own_multipliers(probe.config) if multiplied else None)
        got = got[0] if isinstance(got, tuple) else got
        if not torch.allclose(got[0], want, rtol=1e-4, atol=1e-5 * float(want.abs().max())):
            raise NotNative(KIND, f"{name} is not the Mamba2 recurrence the file computes (largest difference "
                                  f"{float((got[0] - want).abs().max()):.3g})")
    extra = {"MAMBA_MULTIPLIERS": True} if multiplied else {}
    if norm_key:
        extra.update(MAMBA_NORM_KEY=norm_key, MAMBA_NORM_ORDER_KEY=NORM_ORDER_KEY)
    return Match(MAMBA2, options={**({} if parallel else {"LINEAR_ATTENTION": True}), "MAMBA_NORM_GROUPED": min(grouped),
                                  **{option: key for option, key in keys.items() if key != DEFAULT_KEYS[option]},
                                  **extra},
                 facts={"norm_key": norm_key, "multiplied": multiplied})


# falcon_h1's mixer multipliers: its input's, and in_proj's five parts' [gate, x, B, C, dt]
IN_MULTIPLIER, PART_MULTIPLIERS = "ssm_in_multiplier", "ssm_multipliers"
MOVED_MULTIPLIERS = (0.75, [1.5, 0.5, 1.25, 0.625, 2.0])
# falcon_h1's switch of the gated norm and the key of its order (the norm before the gate: not written)
NORM_KEY, NORM_ORDER_KEY = "mamba_rms_norm", "mamba_norm_before_gate"


def own_multipliers(config):
    return float(getattr(config, IN_MULTIPLIER)), [float(v) for v in getattr(config, PART_MULTIPLIERS)]


def _mixer_matches(probe, index: int, **kwargs) -> bool:
    import torch

    module = probe.layers[index].linear_attn
    x = torch.randn(11, probe.hidden, generator=torch.Generator().manual_seed(4))
    grouped = getattr(module.norm, "group_size", module.intermediate_size) != module.intermediate_size \
        or module.n_groups == 1
    with torch.no_grad():
        got = module(x[None])
        got = got[0] if isinstance(got, tuple) else got
        want = formula(module, x, grouped=grouped, **kwargs)
    return torch.allclose(got[0], want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def mixer_multipliers(probe, index: int) -> bool:
    """Whether the mixer scales its input by config.ssm_in_multiplier and in_proj's parts by config.ssm_multipliers
    (falcon_h1's), read on a config with them moved off 1 (at 1 they cannot be seen); False where the config has
    neither key, NotNative where it has them and the mixer does otherwise."""
    value = getattr(probe.config, PART_MULTIPLIERS, None)
    if not isinstance(getattr(probe.config, IN_MULTIPLIER, None), (int, float)) or not isinstance(value, (list, tuple)) \
            or len(value) != 5:
        return False
    moved = probe.variant({IN_MULTIPLIER: MOVED_MULTIPLIERS[0], PART_MULTIPLIERS: MOVED_MULTIPLIERS[1]})
    norm = bool(getattr(moved.config, NORM_KEY, True))
    if not _mixer_matches(moved, index, multipliers=own_multipliers(moved.config), norm=norm):
        raise NotNative(KIND, f"the Mamba2 mixer is not scaled by config.{IN_MULTIPLIER} on its input and "
                              f"config.{PART_MULTIPLIERS} on in_proj's [gate, x, B, C, dt]")
    return True


def norm_switch(probe, index: int) -> str | None:
    """The config key that switches the mixer's gated norm (falcon_h1's mamba_rms_norm: off, y * silu(gate) alone),
    confirmed on the config with it toggled; None where the norm is always there."""
    value = getattr(probe.config, NORM_KEY, None)
    if not isinstance(value, bool):
        return None
    if value and getattr(probe.config, NORM_ORDER_KEY, False):
        raise NotNative(KIND, f"config.{NORM_ORDER_KEY}: the Mamba2 mixer's norm before its gate, which no part writes")
    other = probe.variant({NORM_KEY: not value, NORM_ORDER_KEY: False})
    with_norm, without = (probe, other) if value else (other, probe)
    # on, the norm holds its weight; off, the mixer's norm holds none (transformers' nn.Identity)
    weights = [dict(p.layers[index].linear_attn.norm.named_parameters()) for p in (with_norm, without)]
    if "weight" not in weights[0] or weights[1]:
        raise NotNative(KIND, f"config.{NORM_KEY} does not switch the Mamba2 mixer's gated norm")
    return NORM_KEY


def _variants(match, probe):
    """The file serves the family's other setting of the gated norm, and other multipliers."""
    found = []
    if match.facts.get("norm_key"):
        key = match.facts["norm_key"]
        found.append((f"{key} {not getattr(probe.config, key)}", {key: not getattr(probe.config, key),
                                                                   NORM_ORDER_KEY: False}))
    if match.facts.get("multiplied"):
        found.append(("ssm multipliers", {IN_MULTIPLIER: MOVED_MULTIPLIERS[0],
                                          PART_MULTIPLIERS: MOVED_MULTIPLIERS[1]}))
    return found


def _kernels(match):
    multiplied = (("ssm_in_multiplier and ssm_multipliers: plain torch multiplies of in_proj's input and parts",)
                  if match.options.get("MAMBA_MULTIPLIERS") else ())
    return ((), multiplied + ("in_proj / out_proj: the parallel linears (replicated: attn_tp_size 1)",
                              "causal depthwise conv1d and the Mamba2 state-space recurrence: plain torch in float32, "
                              "token by token (no NPU op in upstream's models computes them)",
                              "the gated RMSNorm: plain torch in float32"))


MAMBA2 = Part(
    slot="linear_attention", name="mamba2", code="linear_attention_mamba2.py", provides="ModelMamba2Mixer",
    reads=("layer_types", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
           "mamba_expand", "mamba_conv_bias", "mamba_proj_bias", "time_step_limit", "rms_norm_eps"),
    probe=_probe, kernels=_kernels, variants=_variants,
    options=("LINEAR_ATTENTION", "MAMBA_NORM_GROUPED", *KEYS, "MAMBA_MULTIPLIERS", "MAMBA_NORM_KEY",
             "MAMBA_NORM_ORDER_KEY"))
