"""The decoder layer's shape: pre-norm (the attention's and the MLP's input norms, the next norm adding the
residual) or sandwich (gemma2 / gemma3, glm4, hyperclovax: the attention's and the MLP's outputs normed too) —
the layers' norms by their role in the layer's forward (agent.recipe.native.parts.norm_roles), under the names the
architecture gives them (a layer's other children: agent.recipe.native.parts.model refuses them)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.model import layer_mlp
from agent.recipe.native.parts.norm import LAYER_NORMS
from agent.recipe.native.parts.norm_roles import ROLES, norm_roles
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children

PRE_NORM_ROLES = ("attention_in", "mlp_in")
# the code's module constant naming each role's norm (parts/code/block.py)
ROLE_OPTIONS = {"attention_in": "ATTENTION_NORM", "attention_out": "ATTENTION_OUT_NORM", "mlp_in": "MLP_NORM",
                "mlp_out": "MLP_OUT_NORM"}


def layer_norms(probe) -> set:
    """The norms each layer has by their transformers names (one tuple for all layers, or NotNative)."""
    kinds = set()
    for layer in probe.layers:
        names = children(layer)
        present = tuple(n for n in LAYER_NORMS if n in names)
        if present not in (LAYER_NORMS[:2], LAYER_NORMS):
            raise NotNative("decoder layer", f"norms {present}: neither pre-norm nor sandwich")
        kinds.add(present)
    if len(kinds) != 1:
        raise NotNative("decoder layer", "layers of unequal structure")
    return kinds


def block_roles(probe) -> dict | None:
    """role -> norm name of a pre-norm or sandwich layer (read by role; by transformers' usual names where the
    layer cannot be run with its attention and MLP replaced); None for another layout (post-norm, one norm
    before both: other parts); NotNative for a placement no part writes."""
    roles = norm_roles(probe)
    if not roles:
        names = next(iter(layer_norms(probe)))
        return dict(zip(PRE_NORM_ROLES if len(names) == 2 else ROLES, names))
    if len(set(roles.values())) != len(roles) or "attention_in" not in roles:
        return None           # one norm in two roles (parallel), or no input norm (post-norm)
    if set(roles) not in (set(PRE_NORM_ROLES), set(ROLES)):
        raise NotNative("decoder layer", f"norms by role {roles}: neither pre-norm nor sandwich")
    return roles


def residual_scaled(layer, hidden: int, multiplier: float, roles: dict, depth: int | None = None,
                    final: float = 1.0) -> bool:
    """The layer computes h = x + m * out_a(attn(in_a(x))), then h + m * out_m(mlp(in_m(h))) — the norms by
    role (`roles`: role -> name; an output norm the pre-norm layer has not is the identity): checked with the
    attention and the MLP replaced by fixed maps. With `depth` (the layer's index): beam's depth-scaled sums
    instead, x * sqrt((i - 1) / i) + out / sqrt(i), i = 2 (depth + 1) for the attention and one more for the MLP."""
    import torch

    gen = torch.Generator().manual_seed(8)
    a, b = (torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5 for _ in range(2))
    x = torch.randn(1, 3, hidden, generator=gen)
    # a hybrid's Mamba2 layer (granitemoehybrid's first): the mixer, which returns its output alone, in the attention's place
    linear = not hasattr(layer, "self_attn") and hasattr(layer, "linear_attn")
    attention, mlp = layer.linear_attn if linear else layer.self_attn, layer_mlp(layer)  # the MoE block under another name (granitemoe)
    saved = attention.forward, mlp.forward
    # a shared MLP beside the sparse-MoE block (granitemoehybrid's shared_mlp: the file's shared experts, inside its
    # MLP branch) adds nothing here: the branch is the replaced MLP alone
    from agent.recipe.native.parts.moe import LAYER_SHARED_NAMES

    shared = [child for name, child in children(layer).items() if name in LAYER_SHARED_NAMES and mlp is not child]
    try:
        attention.forward = lambda hidden_states, *args, **kwargs: hidden_states @ a if linear else (hidden_states @ a, None)
        mlp.forward = lambda hidden_states, *args, **kwargs: hidden_states @ b
        for child in shared:
            child.forward = lambda hidden_states, *args, **kwargs: torch.zeros_like(hidden_states)
        with torch.no_grad():
            got = layer(x, attention_mask=None, position_ids=None, position_embeddings=None)
    except Exception:  # noqa: BLE001 - another call shape: not the layer this part writes
        return False
    finally:
        attention.forward, mlp.forward = saved
        for child in shared:
            del child.forward
    got = got[0] if isinstance(got, tuple) else got

    def norm(role):
        return getattr(layer, roles[role]) if role in roles else (lambda t: t)

    def add(residual, out, index):
        if depth is None:
            return residual + multiplier * out
        i = 2 * (depth + 1) + index
        return residual * ((i - 1) / i) ** 0.5 + out / i ** 0.5

    with torch.no_grad():
        h = add(x, norm("attention_out")(norm("attention_in")(x) @ a), 0)
        want = add(h, norm("mlp_out")(norm("mlp_in")(h) @ b), 1) * final     # final: gemma4's layer_scalar
    return torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def role_options(roles: dict) -> dict:
    return {ROLE_OPTIONS[role]: name for role, name in roles.items()}


DEPTH_SCALED = ("each branch joins the residual scaled by the layer's depth (x * sqrt((i - 1) / i) + out / sqrt(i), "
                "i = 2 (layer + 1), one more for the MLP)")


def _unscaled(probe, roles: dict) -> dict:
    """{} where the layer adds its outputs to the residual as they are (a layer read by role: minicpm3 scales them by
    scale_depth / sqrt(num_hidden_layers), which no part writes); {"DEPTH_SCALED_RESIDUAL": True} where every layer
    scales both sums by its depth (beam's, checked on each layer with its own index); NotNative otherwise."""
    if norm_roles(probe) and not residual_scaled(probe.layers[0], probe.hidden, 1.0, roles):
        if all(residual_scaled(layer, probe.hidden, 1.0, roles, depth=index) for index, layer in enumerate(probe.layers)):
            return {"DEPTH_SCALED_RESIDUAL": True}
        raise NotNative("decoder layer", "the layer's outputs join the residual otherwise than as they are "
                                         "(scaled?)")
    return {}


def _pre_norm(probe, chosen):
    roles = block_roles(probe)
    if not roles or set(roles) != set(PRE_NORM_ROLES):
        return None
    if _unscaled(probe, roles):
        raise NotNative("decoder layer", f"{DEPTH_SCALED}, in a pre-norm layer: written in the sandwich layer alone")
    return Match(PRE_NORM, options=role_options(roles))


LAYER_SCALAR = "layer_scalar"   # gemma4's: a buffer of one number per layer, in the checkpoint


def layer_scalar(probe, roles: dict) -> dict:
    """{"LAYER_SCALAR": True} where every layer holds a one-number layer_scalar (gemma4's buffer, stored in the
    checkpoint: 1 in a random model, so its effect is read with it set to 2) that multiplies the layer's whole
    output, residual included; {} where no layer holds one; NotNative for one that acts otherwise."""
    import torch

    held = [getattr(layer, LAYER_SCALAR, None) for layer in probe.layers]
    if all(value is None for value in held):
        return {}
    if any(not isinstance(value, torch.Tensor) or value.numel() != 1 for value in held):
        raise NotNative("decoder layer", f"{LAYER_SCALAR} on some layers only, or not one number")
    layer = probe.layers[0]
    saved = layer.layer_scalar.detach().clone()
    try:
        with torch.no_grad():
            layer.layer_scalar.fill_(2.0)
        scaled = residual_scaled(layer, probe.hidden, 1.0, roles, final=2.0)
    finally:
        with torch.no_grad():
            layer.layer_scalar.copy_(saved)
    if not scaled:
        raise NotNative("decoder layer", f"the layer's {LAYER_SCALAR} does not multiply its output (residual "
                                         "included)")
    return {"LAYER_SCALAR": True}


def _sandwich(probe, chosen):
    roles = block_roles(probe)
    if not roles or set(roles) != set(ROLES):
        return None
    scalar = layer_scalar(probe, roles)
    depth_scaled = {} if scalar else _unscaled(probe, roles)
    return Match(SANDWICH, options={"SANDWICH": True, **role_options(roles), **scalar, **depth_scaled})


PRE_NORM = Part(slot="block", name="pre_norm", code="block.py", provides="ModelDecoderLayer",
                reads=("hidden_size", "rms_norm_eps"), probe=_pre_norm, options=("ATTENTION_NORM", "MLP_NORM"))
SANDWICH = Part(slot="block", name="sandwich", code="block.py", provides="ModelDecoderLayer",
                reads=("hidden_size", "rms_norm_eps"), probe=_sandwich,
                options=("SANDWICH", "LAYER_SCALAR", "DEPTH_SCALED_RESIDUAL", *ROLE_OPTIONS.values()))
