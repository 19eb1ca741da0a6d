"""The sandwich decoder layer with a sparse-MoE branch beside its dense MLP (gemma4's enable_moe_block;
code/block_moe_beside_mlp.py): h = x + out_a(attn(in_a(x))), then
h + norm(out_m(mlp(in_m(h))) + out_e(experts(norm_e(h), router(h)))), the whole times the layer's layer_scalar where it
has one. Read numerically on each layer: the attention, the dense MLP and the experts replaced by fixed maps (the
router kept: its input recorded), the norms found by what they take (the experts' output, the two branches' sum) and
the layer's output held to the formula — with layer_scalar set to 2, as it is 1 in a random model. The branch
itself (router, experts, the experts' norm) is parts/moe_scaled_router.py's."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.block import LAYER_SCALAR, block_roles, role_options
from agent.recipe.native.parts.norm_roles import ROLES
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children, probe_norm


def read_layer(layer, hidden: int, roles: dict, experts_norm: str) -> dict:
    """{"MOE_OUT_NORM": name, "BRANCHES_NORM": name} of a layer whose output is the formula above (NotNative
    otherwise)."""
    import torch

    gen = torch.Generator().manual_seed(9)
    a, b, c = (torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5 for _ in range(3))
    x = torch.randn(1, 5, hidden, generator=gen)
    seen, calls = {}, {}

    def keep(name):
        def hook(module, args, out):
            calls[name] = (args[0] if args else None, out)
        return hook

    def routed(hidden_states, *args, **kwargs):
        seen["experts_out"] = hidden_states @ c
        return seen["experts_out"]

    def router_input(module, args, kwargs):
        seen["router_in"] = (list(args) + list(kwargs.values()))[0]

    others = {name: child for name, child in children(layer).items()
              if name not in ("self_attn", "mlp", "router", "experts")}
    handles = [child.register_forward_hook(keep(name)) for name, child in others.items()]
    handles.append(layer.router.register_forward_pre_hook(router_input, with_kwargs=True))
    scalar = getattr(layer, LAYER_SCALAR, None)
    saved = layer.self_attn.forward, layer.mlp.forward, layer.experts.forward
    saved_scalar = scalar.detach().clone() if scalar is not None else None
    try:
        layer.self_attn.forward = lambda hidden_states, *args, **kwargs: (hidden_states @ a, None)
        layer.mlp.forward = lambda hidden_states, *args, **kwargs: hidden_states @ b
        layer.experts.forward = routed
        with torch.no_grad():
            if scalar is not None:
                scalar.fill_(2.0)
            got = layer(x, attention_mask=None, position_ids=None, position_embeddings=None)
    except Exception as exc:  # noqa: BLE001 - another call shape: not the layer this part writes
        raise NotNative("decoder layer", f"the layer with a sparse-MoE branch cannot be run with its attention, MLP "
                                         f"and experts replaced ({type(exc).__name__})") from exc
    finally:
        layer.self_attn.forward, layer.mlp.forward, layer.experts.forward = saved
        for handle in handles:
            handle.remove()
        if scalar is not None:
            with torch.no_grad():
                scalar.copy_(saved_scalar)
    got = (got[0] if isinstance(got, tuple) else got).reshape(-1, hidden)

    def taking(tensor) -> list:
        return [name for name, (given, _) in calls.items() if isinstance(given, torch.Tensor)
                and given.numel() == tensor.numel() and torch.allclose(given.reshape(-1, hidden), tensor.reshape(-1, hidden))]

    moe_out = taking(seen.get("experts_out", torch.empty(0)))
    if len(moe_out) != 1:
        raise NotNative("decoder layer", "the sparse-MoE branch's output is normed by no one norm of the layer")
    dense_out = calls[roles["mlp_out"]][1]
    branches = taking(dense_out + calls[moe_out[0]][1].reshape(dense_out.shape))
    if len(branches) != 1:
        raise NotNative("decoder layer", "the dense MLP's and the sparse-MoE branch's normed outputs are not summed "
                                         "into one norm")
    norm = {name: getattr(layer, name) for name in (*roles.values(), experts_norm, moe_out[0], branches[0])}
    with torch.no_grad():
        flat = x.reshape(-1, hidden)
        h = flat + norm[roles["attention_out"]](norm[roles["attention_in"]](flat) @ a)
        dense = norm[roles["mlp_out"]](norm[roles["mlp_in"]](h) @ b)
        sparse = norm[moe_out[0]](norm[experts_norm](h) @ c)
        want = (h + norm[branches[0]](dense + sparse)) * (2.0 if scalar is not None else 1.0)
    router_in = seen.get("router_in")
    if router_in is None or not torch.allclose(router_in.reshape(-1, hidden), h, rtol=1e-4, atol=1e-5):
        raise NotNative("decoder layer", "the router does not read the residual stream after the attention")
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise NotNative("decoder layer", "the layer's output is not h + norm(out(mlp(h)) + out(experts(h))) on the "
                                         "residual stream after the attention" +
                        (f" (times its {LAYER_SCALAR}, residual included)" if scalar is not None else ""))
    return {"MOE_OUT_NORM": moe_out[0], "BRANCHES_NORM": branches[0]}


def _probe(probe, chosen):
    from agent.recipe.native.parts.moe_scaled_router import SCALED_ROUTER_MOE, layer_moe

    if not any(layer_moe(layer) for layer in probe.layers):
        return None
    moe = chosen.get("moe")
    if moe is None or moe.part is not SCALED_ROUTER_MOE:
        raise NotNative("decoder layer", "a router and experts beside the dense MLP that the sparse-MoE part does not "
                                         "read")
    roles = block_roles(probe)
    if not roles or set(roles) != set(ROLES):
        raise NotNative("decoder layer", f"norms by role {roles}: not the sandwich's four beside a sparse-MoE branch")
    found = [read_layer(layer, probe.hidden, roles, moe.options["EXPERTS_NORM"]) for layer in probe.layers]
    if any(names != found[0] for names in found):
        raise NotNative("decoder layer", "layers whose sparse-MoE branches are normed under other names")
    options = found[0]
    layer = probe.layers[0]
    kind = probe_norm(getattr(layer, roles["attention_in"]), probe.hidden)
    for name in options.values():
        try:
            same = probe_norm(getattr(layer, name), probe.hidden) == kind
        except NotNative:
            same = False
        if not same:
            raise NotNative("decoder layer", f"the layer's {name} is not the norm its other norms are")
    scalar = all(getattr(layer, LAYER_SCALAR, None) is not None for layer in probe.layers)
    return Match(MOE_BESIDE_MLP, options={"SANDWICH": True, **role_options(roles), **options,
                                          **({"LAYER_SCALAR": True} if scalar else {})})


MOE_BESIDE_MLP = Part(slot="block", name="sandwich_moe_beside_mlp", code="block_moe_beside_mlp.py",
                      provides="ModelMoeBesideMlpDecoderLayer", reads=("hidden_size", "rms_norm_eps"), probe=_probe,
                      options=("SANDWICH", "LAYER_SCALAR", "ATTENTION_NORM", "ATTENTION_OUT_NORM", "MLP_NORM",
                               "MLP_OUT_NORM", "MOE_OUT_NORM", "BRANCHES_NORM"))
