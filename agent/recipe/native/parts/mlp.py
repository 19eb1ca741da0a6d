"""The dense MLP: gated, down(act(gate(x)) * up(x)) with gate / up merged (npu_swiglu where the activation is
silu), read from the layers whose MLP is not a sparse-MoE block (where the checkpoint's layout has none but the
family's can, from a config with one such layer)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.part import Expr, Match, Part
from agent.recipe.native.parts.probe import children
from agent.recipe.native.parts.sub_norm import FFN_SUB_NORM, checked_sub_norm

MLP_CHILDREN = {"gate_proj", "up_proj", "gate_up_proj", "down_proj", "act_fn", "activation_fn", FFN_SUB_NORM}
ACT_KEYS = ("hidden_act", "hidden_activation", "activation_function", "afn", "mlp_hidden_act")  # afn: openai-gpt; mlp_hidden_act: nemotron_h
FIXED_ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "relu", "silu")     # ACT2FN entries an architecture may hard-code
BIAS_KEYS = ("mlp_bias", "use_bias", "enable_bias")             # config keys that may set the MLP's biases


def dense_mlps(probe, chosen) -> tuple:
    """(the probe the dense MLPs were read on, those MLP modules); () where no layer of the family has one."""
    from agent.recipe.native.parts.moe import moe_block

    moe = chosen.get("moe")
    # a one-mixer layer without an MLP (nemotron_h's attention and Mamba2 layers) has none to read
    mlps = [layer.mlp for layer in probe.layers if hasattr(layer, "mlp") and (moe is None or moe_block(layer) is None)]
    if mlps:
        return probe, mlps
    changes = moe.facts.get("dense_variant") if moe is not None else None
    if not changes:
        return ()
    dense = probe.variant(changes)
    return dense, [layer.mlp for layer in dense.layers if hasattr(layer, "mlp") and moe_block(layer) is None]


def act_key(config) -> str:
    for key in ACT_KEYS:
        if isinstance(getattr(config, key, None), str):
            return key
    raise NotNative("mlp", "no hidden_act / hidden_activation in the config")


def _read_roles(mlp, hidden: int, names):
    """(roles {gate_proj, up_proj, down_proj: child name}, activation name) of a gated MLP whose three linears
    carry other names (lfm2's w1 / w3 / w2) or whose activation no config key names: the ordering of its linears
    and the activation of `names` (ACT2FN entries) under which down(act(gate(x)) * up(x)) is what the MLP computes
    (by value: its width may equal the hidden width); None where none fits."""
    from itertools import permutations

    import torch
    from transformers.activations import ACT2FN

    from agent.recipe.native.parts.layout import projection_widths

    m = children(mlp)
    widths = {name: projection_widths(child) for name, child in m.items()}
    if len(m) != 3 or None in widths.values():
        return None
    x = 3 * torch.randn(3, hidden, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = mlp(x)
        for gate, up, down in permutations(m):
            if not widths[gate] == widths[up] == widths[down][::-1] or widths[gate][0] != hidden:
                continue
            for name in names:
                if name in ACT2FN and torch.allclose(got, m[down](ACT2FN[name](m[gate](x)) * m[up](x)),
                                                     rtol=1e-4, atol=1e-5):
                    return {"gate_proj": gate, "up_proj": up, "down_proj": down}, name
    return None


def _read_fused_roles(mlp, hidden: int, names):
    """(roles {gate_up_proj, down_proj: child name}, activation name) of a gated MLP whose gate and up are one
    linear under another name (moshi's fc1, hidden -> 2 x width, its first half the gate) and whose down is the other
    (fc2, width -> hidden): the activation of `names` under which down(act(gate) * up) is what it computes (by
    value); None where none fits."""
    import torch
    from transformers.activations import ACT2FN

    from agent.recipe.native.parts.layout import projection_widths

    m = children(mlp)
    linears = {name: projection_widths(child) for name, child in m.items() if projection_widths(child) is not None}
    others = [name for name in m if name not in linears]
    if len(linears) != 2 or len(others) > 1 or set(linears) & {"gate_up_proj", "down_proj"} == set(linears):
        return None
    pairs = [(gate_up, down) for gate_up, down in (tuple(linears), tuple(linears)[::-1])
             if (linears[gate_up][0], linears[gate_up][1], linears[down][1]) == (hidden, 2 * linears[down][0], hidden)]
    if not pairs:
        return None
    # batch x tokens x hidden: moshi's MLP reads three dimensions
    x = 3 * torch.randn(1, 3, hidden, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        try:
            got = mlp(x)
        except Exception:  # noqa: BLE001 - another call shape (bloom's MLP adds the residual itself): not this MLP
            return None
        for gate_up, down in pairs:
            gate, up = m[gate_up](x).chunk(2, dim=-1)
            for name in names:
                if name in ACT2FN and torch.allclose(got, m[down](ACT2FN[name](gate) * up), rtol=1e-4, atol=1e-5):
                    return {"gate_up_proj": gate_up, "down_proj": down}, name
    return None


def _probe_formula(mlp, hidden: int, activation, multipliers=(1.0, 1.0)) -> None:
    """The MLP is down(act(gate(x)) * up(x)) (separate or fused gate/up; bitnet's ffn_sub_norm of act(gate(x)) *
    up(x) before down; `multipliers` (g, d): down(act(g gate(x)) * up(x)) d, falcon_h1's), nothing else."""
    import torch

    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(3))
    parts = children(mlp)
    with torch.no_grad():
        if "gate_up_proj" in parts:
            gate, up = parts["gate_up_proj"](x).chunk(2, dim=-1)
        else:
            gate, up = parts["gate_proj"](x), parts["up_proj"](x)
        inner = activation(gate * multipliers[0]) * up
        expected = parts["down_proj"](parts[FFN_SUB_NORM](inner) if FFN_SUB_NORM in parts else inner) * multipliers[1]
        got = mlp(x)
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        raise NotNative("mlp", f"{type(mlp).__name__} is not down(act(gate(x)) * up(x))")


MULTIPLIERS_KEY = "mlp_multipliers"      # falcon_h1's (gate, down) multipliers
MOVED_MULTIPLIERS = [1.5, 0.625]          # the values they are read at (1 hides them)


def mlp_multipliers(source, activation) -> str | None:
    """config.mlp_multipliers where the MLP computes down(act(g gate(x)) * up(x)) d by it (read on a config with them
    moved off 1); None where the config has no such pair."""
    from transformers.activations import ACT2FN

    value = getattr(source.config, MULTIPLIERS_KEY, None)
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    moved = source.variant({MULTIPLIERS_KEY: MOVED_MULTIPLIERS})
    mlp = next(layer.mlp for layer in moved.layers if hasattr(layer, "mlp"))
    _probe_formula(mlp, moved.hidden, ACT2FN[activation], tuple(MOVED_MULTIPLIERS))
    return MULTIPLIERS_KEY


def down_name(mlp) -> str | None:
    """The MLP's down projection's name: down_proj, or the plain MLP's read by its role (gpt2's c_proj)."""
    from agent.recipe.native.parts.layout import mlp_roles

    return "down_proj" if "down_proj" in children(mlp) else (mlp_roles(mlp) or {}).get("down_proj")


def bias_option(probe, present: bool):
    """The projections' bias: Expr(config.<key>) where a key toggles it, else the literal."""
    import torch

    for key in BIAS_KEYS:
        value = probe.config.to_dict().get(key)
        if not isinstance(value, bool) or present != value:
            continue
        try:
            other = probe.variant({key: not value})
        except NotNative:
            continue
        down = next((children(layer.mlp).get(down_name(layer.mlp)) for layer in other.layers if hasattr(layer, "mlp")),
                    None)
        if down is not None and isinstance(getattr(down, "bias", None), torch.Tensor) != present:
            return Expr(f"config.{key}")
    return present


def _gated(probe, chosen):
    import torch
    from transformers.activations import ACT2FN

    found = dense_mlps(probe, chosen)
    if not found:
        return None
    source, mlps = found
    key = next((k for k in ACT_KEYS if isinstance(getattr(source.config, k, None), str)), None)
    if set(children(mlps[0])) - MLP_CHILDREN or key is None:
        names = (getattr(source.config, key),) if key else FIXED_ACTIVATIONS
        read = _read_roles(mlps[0], source.hidden, names)
        if read is not None:
            return _by_roles(source, mlps, key, names, *read)
        fused = _read_fused_roles(mlps[0], source.hidden, names)
        if fused is not None:
            return _by_fused_roles(source, mlps, key, names, *fused)
    key = act_key(source.config)
    activation = getattr(source.config, key)
    kinds, biases, sub_norms = set(), set(), set()
    multipliers_key = mlp_multipliers(source, activation)
    multipliers = tuple(float(v) for v in getattr(source.config, multipliers_key)) if multipliers_key else (1.0, 1.0)
    for mlp in mlps:
        m = children(mlp)
        if set(m) - MLP_CHILDREN or "down_proj" not in m or not ({"gate_proj", "up_proj"} <= set(m) or "gate_up_proj" in m):
            raise NotNative("mlp", f"{type(mlp).__name__} ({sorted(m)}) is not a gated MLP")
        linears = [p for p in m.values() if isinstance(p, torch.nn.Linear)]
        biases.add(tuple(p.bias is not None for p in linears))
        kinds.add("gate_up_proj" in m)
        sub_norms.add(checked_sub_norm(mlp, FFN_SUB_NORM, source.config.intermediate_size, source.config))
        _probe_formula(mlp, source.hidden, ACT2FN[activation], multipliers)
    if len(kinds) != 1 or len(biases) != 1 or len(set(next(iter(biases)))) > 1 or len(sub_norms) != 1:
        raise NotNative("mlp", "dense MLPs of unequal structure, or biases on some of their projections only")
    fused = next(iter(kinds))
    swiglu = activation in ("silu", "swish")
    options = {"SWIGLU": swiglu, "ACT": key, "MLP_BIAS": bias_option(source, next(iter(biases))[0]),
               "STACKED_PARAMS": () if fused else (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))}
    if sub_norms == {True}:
        options["FFN_SUB_NORM"] = True
    if multipliers_key:
        options["MLP_MULTIPLIERS"] = multipliers_key
    return Match(GATED_MLP, options=options, facts={"activation": activation})


def _check_read_by_role(source, mlps, key, names, roles: dict, activation: str, read) -> None:
    """What every gated MLP read by role must hold (`read`: _read_roles or _read_fused_roles): no mlp_multipliers
    (written for the MLP under its own names), an activation the file can name, every layer read alike, no biases."""
    if getattr(source.config, MULTIPLIERS_KEY, None) is not None:
        raise NotNative("mlp", f"config.{MULTIPLIERS_KEY} on {type(mlps[0]).__name__}, an MLP read by role: only the gated "
                               "MLP under its own names scales its gate and output")
    if key is None and activation not in ("silu", "swish"):
        raise NotNative("mlp", f"no hidden_act / hidden_activation in the config, and {type(mlps[0]).__name__} "
                               f"computes {activation}, which the file would have to fix in code")
    for mlp in mlps:
        if read(mlp, source.hidden, names) != (roles, activation):
            raise NotNative("mlp", "dense MLPs of unequal structure")
        if any(getattr(children(mlp)[n], "bias", None) is not None for n in roles.values()):
            raise NotNative("mlp", f"{type(mlp).__name__}: biases on the projections of a gated MLP read by role")


def _by_roles(source, mlps, key, names, roles: dict, activation: str):
    """The gated MLP whose linears carry other names (renamed at load to gate_proj / up_proj / down_proj) or whose
    activation no config key names (silu only: npu_swiglu; the file then reads no key), its width
    config.intermediate_size or the block-adjusted width of lfm2's config keys."""
    _check_read_by_role(source, mlps, key, names, roles, activation, _read_roles)
    width = children(mlps[0])[roles["gate_proj"]].out_features
    adjusted = width != source.config.intermediate_size
    if adjusted and not _auto_adjusted(source, width, roles["gate_proj"]):
        raise NotNative("mlp", f"gated MLP of width {width}: neither config.intermediate_size "
                               f"({source.config.intermediate_size}) nor its block-adjusted width")
    renames = tuple((f"\\.mlp\\.{name}\\.", f".mlp.{role}.") for role, name in roles.items() if name != role)
    options = {"SWIGLU": activation in ("silu", "swish"), "ACT": key or "hidden_act", "MLP_BIAS": False,
               "STACKED_PARAMS": (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)),
               "CHECKPOINT_RENAMES": renames, "FF_AUTO_ADJUST": adjusted}
    return Match(GATED_MLP, options=options, facts={"activation": activation})


def gate_up_width_key(source, width: int, gate_up: str) -> str | None:
    """The config key holding the merged gate / up linear's whole width where config.intermediate_size is not its
    half (moshi's ffn_dim, 2 x the width): the one int key of that value that the linear follows on a config with the
    key moved; None where intermediate_size is the width."""
    if getattr(source.config, "intermediate_size", None) == width:
        return None
    keys = [key for key, value in source.config.to_dict().items()
            if isinstance(value, int) and not isinstance(value, bool) and value == 2 * width]
    for key in keys:
        try:
            other = source.variant({key: 2 * width + 4})
        except NotNative:
            continue
        mlp = next((layer.mlp for layer in other.layers if hasattr(layer, "mlp")), None)
        if mlp is not None and getattr(children(mlp).get(gate_up), "out_features", None) == 2 * width + 4:
            return key
    raise NotNative("mlp", f"gated MLP of width {width}: neither config.intermediate_size nor half of a config key "
                           "its merged gate / up linear follows")


def _by_fused_roles(source, mlps, key, names, roles: dict, activation: str):
    """The gated MLP whose gate / up linear is one under another name (moshi's fc1, fc2), renamed at load to
    gate_up_proj / down_proj, its width config.intermediate_size or half the key its gate_up follows (ffn_dim)."""
    _check_read_by_role(source, mlps, key, names, roles, activation, _read_fused_roles)
    width = children(mlps[0])[roles["down_proj"]].in_features
    renames = tuple((f"\\.mlp\\.{name}\\.", f".mlp.{role}.") for role, name in roles.items() if name != role)
    options = {"SWIGLU": activation in ("silu", "swish"), "ACT": key or "hidden_act", "MLP_BIAS": False,
               "STACKED_PARAMS": (), "CHECKPOINT_RENAMES": renames,
               "GATE_UP_WIDTH_KEY": gate_up_width_key(source, width, roles["gate_up_proj"]) or ""}
    return Match(GATED_MLP, options=options, facts={"activation": activation})


def auto_adjusted_width(config) -> int:
    """lfm2's MLP width from its config (Lfm2MLP): 2/3 of intermediate_size where block_auto_adjust_ff_dim, times
    block_ffn_dim_multiplier rounded up to block_multiple_of (code/mlp_gated.py's block_ff_width)."""
    width = config.intermediate_size
    if getattr(config, "block_auto_adjust_ff_dim", False):
        width = int(2 * width / 3)
        if config.block_ffn_dim_multiplier is not None:
            width = int(config.block_ffn_dim_multiplier * width)
            width = config.block_multiple_of * ((width + config.block_multiple_of - 1) // config.block_multiple_of)
    return width


def _auto_adjusted(source, width: int, gate: str) -> bool:
    """The MLP's width is auto_adjusted_width of the config, on this config and on one with the keys moved."""
    if auto_adjusted_width(source.config) != width:
        return False
    try:
        other = source.variant({"block_ffn_dim_multiplier": 2.0, "block_multiple_of": 16})
    except NotNative:
        return False
    mlp = next(layer.mlp for layer in other.layers)
    return children(mlp)[gate].out_features == auto_adjusted_width(other.config)


def _kernels(match):
    sub_norm = (("MLP sub-norm before down_proj: RMSNorm over the intermediate width in plain torch (its sum of "
                 "squares all-reduced over the tensor-parallel ranks; npu_rms_norm norms one rank's slice)",)
                if match.options.get("FFN_SUB_NORM") else ())
    if match.options.get("MLP_MULTIPLIERS"):
        sub_norm += (f"{match.options['MLP_MULTIPLIERS']}: plain torch multiplies of the gate and the output",)
    if match.options["SWIGLU"]:
        return ("npu_swiglu (gate/up)",), sub_norm
    return (), (f"MLP activation {match.facts['activation']} * up: plain torch (npu_swiglu is silu only)",) + sub_norm


def bias_variants(match, probe):
    """The file serves the other setting of the config key that sets the MLP's biases, and other multipliers."""
    value = match.options["MLP_BIAS"]
    found = []
    if isinstance(value, Expr):
        key = value.code.split(".", 1)[1]
        found.append((f"bias {key}", {key: not getattr(probe.config, key)}))
    if match.options.get("MLP_MULTIPLIERS"):
        found.append(("mlp multipliers", {match.options["MLP_MULTIPLIERS"]: [0.75, 1.25]}))
    return found


GATED_MLP = Part(
    slot="mlp", name="gated_mlp", code="mlp_gated.py", provides="ModelMLP",
    reads=("hidden_size", "intermediate_size", "hidden_act", "mlp_bias"), probe=_gated, kernels=_kernels,
    options=("SWIGLU", "ACT", "MLP_BIAS", "STACKED_PARAMS", "CHECKPOINT_RENAMES", "FF_AUTO_ADJUST", "FFN_SUB_NORM",
             "MLP_MULTIPLIERS", "GATE_UP_WIDTH_KEY"),
    variants=bias_variants)
