"""The sparse-MoE branch a decoder layer holds itself, beside its dense MLP (gemma4's enable_moe_block: the layer's
own `router` and `experts`), with a router that scales its own input (code/moe_scaled_router.py): read from the
layer of transformers' model, numerically.

* routing: the layer run with its attention replaced by zeros (the residual stream entering the feed-forward half is
  then the layer's input x) and the experts' call captured; the experts' chosen indices and weights must be
  top-k(softmax(proj(rms(x) * scale * hidden_size ** -0.5))), renormalised, times per_expert_scale of the chosen
  experts — read with the router's scale and per_expert_scale moved off their initial ones (a random model's, where
  neither would show);
* the experts' input: the output of one norm of the layer (x * w over the RMS, config.rms_norm_eps) taken on x, the
  block's experts norm (EXPERTS_NORM; the checkpoint's tensor renamed into the block);
* experts: one expert against parts/moe.py's candidates (gelu-tanh over gate / up halves: npu_geglu).

The layer's shape around the branch (the branches' norms and sum) is parts/block_moe_beside_mlp.py's."""

from __future__ import annotations

import copy

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import children, probe_norm

MOE_NAME = "moe_block"     # the block's name in the native layer (parts/code/block_moe_beside_mlp.py's MOE_NAME)
TOPK_KEYS = ("top_k_experts",)
EXPERT_COUNT_KEYS = ("num_experts",)
WIDTH_KEYS = ("moe_intermediate_size",)
OWN = ("self_attn", "mlp", "router", "experts")


def layer_moe(layer) -> bool:
    """Whether the layer holds a router and routed experts (fused 3-D parameters) itself, beside its dense `mlp`."""
    names = children(layer)
    experts = names.get("experts")
    gate_up = getattr(experts, "gate_up_proj", None)
    return {"router", "experts", "mlp"} <= set(names) and getattr(gate_up, "dim", lambda: 0)() == 3


def scaled_router(x, weight, scale, per_expert_scale, k: int, eps: float):
    """The scaled router's routing in plain torch (fp32): (weights [T, k], indices [T, k])."""
    import torch

    x = x.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    logits = (normed * scale.float() * x.shape[-1] ** -0.5) @ weight.float().t()
    weights, index = logits.softmax(-1).topk(k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    return weights * per_expert_scale.float()[index], index


def router_linear(router, hidden: int, experts: int) -> str:
    """The name of the router's one linear (hidden -> experts, no bias), beside its own `scale` [hidden] and
    `per_expert_scale` [experts] (NotNative where it holds other parameters, or these under other names)."""
    import torch

    linears = [name for name, m in router.named_children() if isinstance(m, torch.nn.Linear)
               and (m.in_features, m.out_features) == (hidden, experts) and m.bias is None]
    own = {name: tuple(p.shape) for name, p in router._parameters.items() if p is not None}
    if len(linears) != 1 or own != {"scale": (hidden,), "per_expert_scale": (experts,)} \
            or any(p.numel() for name, m in router.named_children() if name not in linears for p in m.parameters()):
        raise NotNative("moe", f"the layer's router {type(router).__name__} holds {sorted(own)} and linears {linears}: "
                               "not one bias-free linear to the experts, a scale of the hidden width and a "
                               "per_expert_scale")
    return linears[0]


def read_branch(layer, x):
    """(the experts' input, indices, weights, the norms' calls {name: (input, output)}) of `layer` run on x with its
    attention replaced by zeros."""
    import torch

    seen, calls = {}, {}

    def capture(module, args, kwargs):
        values = list(args) + list(kwargs.values())
        seen["input"], seen["index"], seen["weights"] = (values + [None] * 3)[:3]

    def keep(name):
        def hook(module, args, out):
            calls[name] = (args[0] if args else None, out)
        return hook

    names = children(layer)
    handles = [layer.experts.register_forward_pre_hook(capture, with_kwargs=True)]
    handles += [child.register_forward_hook(keep(name)) for name, child in names.items() if name not in OWN]
    saved = layer.self_attn.forward
    try:
        layer.self_attn.forward = lambda hidden_states, *args, **kwargs: (torch.zeros_like(hidden_states), None)
        with torch.no_grad():
            layer(x, attention_mask=None, position_ids=None, position_embeddings=None)
    except Exception as exc:  # noqa: BLE001 - another call shape: not the layer this part writes
        raise NotNative("moe", f"the layer with its router and experts cannot be run on its own "
                               f"({type(exc).__name__})") from exc
    finally:
        layer.self_attn.forward = saved
        for handle in handles:
            handle.remove()
    if not isinstance(seen.get("index"), torch.Tensor) or not isinstance(seen.get("weights"), torch.Tensor):
        raise NotNative("moe", "the layer does not call its experts with (hidden, indices, weights)")
    return seen["input"], seen["index"], seen["weights"], calls


def experts_norm(calls: dict, experts_input, x, hidden: int, config, layer) -> str:
    """The name of the norm whose output the experts take, checked to norm the residual stream x (x * w over the
    RMS with config.rms_norm_eps)."""
    import torch

    found = [name for name, (_, out) in calls.items() if out is experts_input]
    if len(found) != 1:
        raise NotNative("moe", "the experts' input is no one norm's output of the layer")
    name = found[0]
    norm = getattr(layer, name)
    given = calls[name][0]
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    try:
        offset = probe_norm(norm, hidden)
    except NotNative as exc:
        raise NotNative("moe", f"the experts' input norm {name}: {exc.reason}") from exc
    if offset != 0.0 or eps != getattr(config, "rms_norm_eps", None) \
            or not torch.allclose(given.reshape(-1, hidden), x.reshape(-1, hidden)):
        raise NotNative("moe", f"the experts' input norm {name} is not x * w over the RMS (config.rms_norm_eps) of "
                               "the residual stream")
    return name


def _config_key(config, keys: tuple, what: str) -> str:
    key = next((k for k in keys if isinstance(getattr(config, k, None), int) and getattr(config, k) > 0), None)
    if key is None:
        raise NotNative("moe", f"no {what} in the config ({' / '.join(keys)})")
    return key


def derive_scaled_router(probe) -> dict | None:
    """The options of the layers' own sparse-MoE branch; None where no layer holds one."""
    import torch

    from agent.recipe.native.parts.moe import _probe_experts, _same_routing

    held = [layer_moe(layer) for layer in probe.layers]
    if not any(held):
        return None
    if not all(held):
        raise NotNative("moe", "a router and experts in some layers only, beside the dense MLP: no part writes it")
    config, hidden = probe.config, probe.hidden
    experts_key = _config_key(config, EXPERT_COUNT_KEYS, "routed expert count")
    topk_key = _config_key(config, TOPK_KEYS, "experts per token")
    experts, k = getattr(config, experts_key), getattr(config, topk_key)
    layer = copy.deepcopy(probe.layers[0])
    down = layer.experts.down_proj
    width = down.shape[-1] if down.shape[-2] == hidden else down.shape[-2]
    width_key = next((key for key in WIDTH_KEYS if getattr(config, key, None) == width), None)
    if width_key is None:
        raise NotNative("moe", f"the experts' width {width} is none of the config's {' / '.join(WIDTH_KEYS)}")
    router = layer.router
    proj_name = router_linear(router, hidden, experts)
    proj = getattr(router, proj_name)
    gen = torch.Generator().manual_seed(21)
    with torch.no_grad():
        proj.weight.copy_(torch.randn(proj.weight.shape, generator=gen))
        # off their initial ones, so that the routing shows them
        router.scale.copy_(1 + 0.5 * torch.randn(router.scale.shape, generator=gen))
        router.per_expert_scale.copy_(1 + 0.5 * torch.rand(router.per_expert_scale.shape, generator=gen))
    x = torch.randn(1, 24, hidden, generator=gen)
    experts_input, index, weights, calls = read_branch(layer, x)
    eps = getattr(config, "rms_norm_eps", None)
    want = scaled_router(x.reshape(-1, hidden), proj.weight, router.scale, router.per_expert_scale, k, eps)
    if not isinstance(eps, float) or not _same_routing(index.reshape(-1, k), weights.reshape(-1, k), want[1], want[0]):
        raise NotNative("moe", f"the layer's router {type(router).__name__} routes otherwise than top-k of the softmax "
                               "of proj(rms(x) * scale / sqrt(hidden)) on the residual stream, renormalised, times "
                               "per_expert_scale")
    norm = experts_norm(calls, experts_input, x, hidden, config, layer)
    kind, activation, layout = _probe_experts(layer.experts, config, hidden)
    if (kind, activation) != ("gmm", "geglu_tanh"):
        raise NotNative("moe", f"the layer's experts compute {activation}, not gelu-tanh(gate) * up: no part writes "
                               "it beside the dense MLP")
    return {"MOE": True, "EXPERTS_KEY": experts_key, "TOPK_KEY": topk_key, "WIDTH_KEY": width_key,
            "ROUTER": "router", "ROUTER_STORED": f"router.{proj_name}",
            "SCORING": "softmax", "RENORMALIZE": True, "EXPERTS": "gmm", "GEGLU": True, "FUSED_LAYOUT": layout,
            "EXPERTS_NORM": norm,
            # the layer's router, experts and the experts' norm are the native layer's sparse-MoE block's
            "CHECKPOINT_RENAMES": tuple((f"\\.{name}\\.", f".{MOE_NAME}.{name}.") for name in ("router", "experts", norm))}


def _probe(probe, chosen):
    options = derive_scaled_router(probe)
    if options is None:
        return None
    return Match(SCALED_ROUTER_MOE, options=options)


SCALED_ROUTER_MOE = Part(
    slot="moe", name="sparse_moe_scaled_router", code="moe_scaled_router.py", provides="ModelScaledRouterSparseMoeBlock",
    reads=("num_experts", "top_k_experts", "moe_intermediate_size", "rms_norm_eps", "hidden_size"),
    probe=_probe,
    kernels=lambda m: (("npu_rms_norm (the router's, on ones)", "npu_moe_gating_top_k_softmax", "npu_moe_init_routing_v2",
                        "npu_grouped_matmul", "npu_geglu", "npu_moe_finalize_routing"),
                       ("the router's scale, 1 / sqrt(hidden_size) and per_expert_scale in plain torch",)),
    options=("MOE", "EXPERTS_KEY", "TOPK_KEY", "WIDTH_KEY", "ROUTER", "ROUTER_STORED", "SCORING", "RENORMALIZE", "EXPERTS",
             "GEGLU", "FUSED_LAYOUT", "EXPERTS_NORM", "CHECKPOINT_RENAMES"))
