"""The dense MLP: gated, down(act(gate(x)) * up(x)) with gate / up merged (npu_swiglu where the activation is
silu), read from the layers whose MLP is not a sparse-MoE block (where the checkpoint's layout has none but the
family's can, from a config with one such layer)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.part import Expr, Match, Part
from agent.recipe.native.parts.probe import children
from agent.recipe.native.parts.sub_norm import FFN_SUB_NORM, checked_sub_norm

MLP_CHILDREN = {"gate_proj", "up_proj", "gate_up_proj", "down_proj", "act_fn", "activation_fn", FFN_SUB_NORM}
ACT_KEYS = ("hidden_act", "hidden_activation", "activation_function", "afn")     # afn: openai-gpt
BIAS_KEYS = ("mlp_bias", "use_bias", "enable_bias")             # config keys that may set the MLP's biases


def dense_mlps(probe, chosen) -> tuple:
    """(the probe the dense MLPs were read on, those MLP modules); () where no layer of the family has one."""
    from agent.recipe.native.parts.moe import moe_block

    moe = chosen.get("moe")
    mlps = [layer.mlp for layer in probe.layers if moe is None or moe_block(layer) is None]
    if mlps:
        return probe, mlps
    changes = moe.facts.get("dense_variant") if moe is not None else None
    if not changes:
        return ()
    dense = probe.variant(changes)
    return dense, [layer.mlp for layer in dense.layers if moe_block(layer) is None]


def act_key(config) -> str:
    for key in ACT_KEYS:
        if isinstance(getattr(config, key, None), str):
            return key
    raise NotNative("mlp", "no hidden_act / hidden_activation in the config")


def _probe_formula(mlp, hidden: int, activation) -> None:
    """The MLP is down(act(gate(x)) * up(x)) (separate or fused gate/up; bitnet's ffn_sub_norm of act(gate(x)) *
    up(x) before down), nothing else."""
    import torch

    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(3))
    parts = children(mlp)
    with torch.no_grad():
        if "gate_up_proj" in parts:
            gate, up = parts["gate_up_proj"](x).chunk(2, dim=-1)
        else:
            gate, up = parts["gate_proj"](x), parts["up_proj"](x)
        inner = activation(gate) * up
        expected = parts["down_proj"](parts[FFN_SUB_NORM](inner) if FFN_SUB_NORM in parts else inner)
        got = mlp(x)
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        raise NotNative("mlp", f"{type(mlp).__name__} is not down(act(gate(x)) * up(x))")


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
        down = next((children(layer.mlp).get(down_name(layer.mlp)) for layer in other.layers), None)
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
    key = act_key(source.config)
    activation = getattr(source.config, key)
    kinds, biases, sub_norms = set(), set(), set()
    for mlp in mlps:
        m = children(mlp)
        if set(m) - MLP_CHILDREN or "down_proj" not in m or not ({"gate_proj", "up_proj"} <= set(m) or "gate_up_proj" in m):
            raise NotNative("mlp", f"{type(mlp).__name__} ({sorted(m)}) is not a gated MLP")
        linears = [p for p in m.values() if isinstance(p, torch.nn.Linear)]
        biases.add(tuple(p.bias is not None for p in linears))
        kinds.add("gate_up_proj" in m)
        sub_norms.add(checked_sub_norm(mlp, FFN_SUB_NORM, source.config.intermediate_size, source.config))
        _probe_formula(mlp, source.hidden, ACT2FN[activation])
    if len(kinds) != 1 or len(biases) != 1 or len(set(next(iter(biases)))) > 1 or len(sub_norms) != 1:
        raise NotNative("mlp", "dense MLPs of unequal structure, or biases on some of their projections only")
    fused = next(iter(kinds))
    swiglu = activation in ("silu", "swish")
    options = {"SWIGLU": swiglu, "ACT": key, "MLP_BIAS": bias_option(source, next(iter(biases))[0]),
               "STACKED_PARAMS": () if fused else (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))}
    if sub_norms == {True}:
        options["FFN_SUB_NORM"] = True
    return Match(GATED_MLP, options=options, facts={"activation": activation})


def _kernels(match):
    sub_norm = (("MLP sub-norm before down_proj: RMSNorm over the intermediate width in plain torch (its sum of "
                 "squares all-reduced over the tensor-parallel ranks; npu_rms_norm norms one rank's slice)",)
                if match.options.get("FFN_SUB_NORM") else ())
    if match.options["SWIGLU"]:
        return ("npu_swiglu (gate/up)",), sub_norm
    return (), (f"MLP activation {match.facts['activation']} * up: plain torch (npu_swiglu is silu only)",) + sub_norm


def bias_variants(match, probe):
    """The file serves the other setting of the config key that sets the MLP's biases."""
    value = match.options["MLP_BIAS"]
    if isinstance(value, Expr):
        key = value.code.split(".", 1)[1]
        return [(f"bias {key}", {key: not getattr(probe.config, key)})]
    return []


GATED_MLP = Part(
    slot="mlp", name="gated_mlp", code="mlp_gated.py", provides="ModelMLP",
    reads=("hidden_size", "intermediate_size", "hidden_act", "mlp_bias"), probe=_gated, kernels=_kernels,
    options=("SWIGLU", "ACT", "MLP_BIAS", "STACKED_PARAMS", "FFN_SUB_NORM"), variants=bias_variants)
