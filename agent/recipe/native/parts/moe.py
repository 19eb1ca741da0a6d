"""The sparse-MoE block (code/moe.py), read from the architecture's transformers code and config.

Nothing here is a per-model table. The transformers model is built on the meta device from the config (every
layer, no memory) to find which layers are sparse and where the MoE block sits, and again with the config's
layout keys changed to see which key decides it (first_k_dense_replace, num_dense_layers, mlp_layer_types,
decoder_sparse_step with mlp_only_layers; none: every layer); the block's class is then built on a shrunk copy
(fp32, random weights, the same expert / group counts) and probed numerically:

* routing: the block's experts module is called with the routing the block computed (tokens' expert
  indices and weights, captured); candidate gatings (softmax or sigmoid scores, a selection bias,
  grouped top-k by max or top-2 sum, renormalised or not, routed scaling) are computed from the
  captured router logits' inputs and the one that gives the same experts and weights is the block's
  (the renormalisation read from config.norm_topk_prob where toggling it changes the block's);
* experts: one expert's output for a known input against the candidate formulas (gate/up halves and
  the config's activation, as `npu_swiglu` computes it; gpt_oss's interleaved gate/up with clamp
  limit / alpha, `up + 1` and per-expert biases);
* checkpoint names: transformers' own conversion mapping (`transformers.conversion_mapping`), which
  merges the checkpoint's per-expert tensors into the fused 3-D parameters (w1/w3/w2 or
  gate_proj/up_proj/down_proj); none: the checkpoint stores the fused tensors (gpt_oss). Renames of the
  block itself (mixtral's `block_sparse_moe`) are the skeleton's (agent.recipe.native.parts.model).

Anything not recognised raises `NotNative("moe", reason)`: the recipe keeps the adapter.
"""

from __future__ import annotations

import copy
import re
from dataclasses import replace

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.part import Expr, Match, Part

EXPERT_COUNT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "moe_k")
MOE_WIDTH_KEYS = ("moe_intermediate_size", "intermediate_size")
ROUTER_NAMES = ("gate", "router")
SHARED_NAMES = ("shared_experts", "shared_expert", "shared_mlp")   # hunyuan_v1_moe: shared_mlp in the block
# the dense MLP's bias keys (parts/mlp.py BIAS_KEYS, which imports this module): the shared experts are its class
SHARED_BIAS_KEYS = ("mlp_bias", "use_bias", "enable_bias")
LAYER_SHARED_NAMES = ("shared_mlp",)    # shared experts beside the block in the layer (granitemoeshared)
# The shrunk probe: small widths, the real counts where routing depends on them (groups), capped.
PROBE_HIDDEN, PROBE_WIDTH, PROBE_EXPERT_CAP = 40, 24, 256   # no width (24, 28, 32) nor twice one equals hidden
LAYOUT_LAYERS = 4        # the layers of the config copies the layout rule is checked on


def _config_key(config, keys: tuple[str, ...], what: str, checkpoint_keys=()) -> str:
    """The first of `keys` the config sets: a name of the checkpoint's config.json first (what the
    generated code reads with upstream's transformers pin), then one this release stores (not an
    attribute_map alias, which another release may lack)."""
    stored = config.to_dict()
    ordered = sorted(keys, key=lambda k: (k not in checkpoint_keys, k not in stored))
    for key in ordered:
        if isinstance(getattr(config, key, None), int) and getattr(config, key) > 0:
            return key
    listed = next((k for k in ordered if isinstance(getattr(config, k, None), (list, tuple))), None)
    if listed is not None and keys == TOPK_KEYS and _per_layer_ints(getattr(config, listed), config):
        return listed         # hunyuan_v1_moe's moe_topk per layer: the block reads its layer's entry
    if listed is not None:
        raise NotNative("moe", f"the {what} per layer ({listed} a list): the native block reads one number")
    raise NotNative("moe", f"no {what} in the config ({' / '.join(keys)})")


def _per_layer_ints(value, config) -> bool:
    """A list of one positive int per decoder layer."""
    return len(value) == getattr(config, "num_hidden_layers", None) and \
        all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)


def _top_k(config) -> int:
    """The experts per token (the most of any layer where the config gives them per layer)."""
    value = getattr(config, _config_key(config, TOPK_KEYS, "experts per token"))
    return int(max(value) if isinstance(value, (list, tuple)) else value)


def top_k_per_layer(config) -> bool:
    """Whether the config gives the experts per token as a list per layer (hunyuan_v1_moe's moe_topk)."""
    return isinstance(getattr(config, _config_key(config, TOPK_KEYS, "experts per token")), (list, tuple))


def moe_block(layer):
    """(attribute name, module) of the layer's sparse-MoE block: a child with an `experts` module
    holding fused 3-D expert parameters; None for a dense layer."""
    for name, child in layer.named_children():
        experts = getattr(child, "experts", None)
        if experts is not None and getattr(experts, "gate_up_proj", None) is not None \
                and getattr(experts.gate_up_proj, "dim", lambda: 0)() == 3:
            return name, child
    return None



def _probe_config(config):
    """A shrunk copy: tiny widths, the routed expert count and groups kept (capped), fp32."""
    import torch

    probe = copy.deepcopy(config)
    probe.hidden_size = PROBE_HIDDEN
    # distinct widths: which config key sizes the experts (and the shared experts) is read off their shapes
    for offset, key in enumerate(MOE_WIDTH_KEYS + ("shared_expert_intermediate_size", "shared_intermediate_size",
                                                   "shared_experts_intermediate_size")):
        if isinstance(getattr(probe, key, None), int):
            setattr(probe, key, PROBE_WIDTH + 4 * offset)
    experts_key = _config_key(probe, EXPERT_COUNT_KEYS, "routed expert count")
    count = getattr(probe, experts_key)
    if count > PROBE_EXPERT_CAP:
        groups = getattr(probe, "n_group", None) or 1
        setattr(probe, experts_key, PROBE_EXPERT_CAP - PROBE_EXPERT_CAP % groups)
    topk_key = _config_key(probe, TOPK_KEYS, "experts per token")
    if isinstance(getattr(probe, topk_key), (list, tuple)):
        setattr(probe, topk_key, int(getattr(probe, topk_key)[0]))    # the block built on its own: layer 0's
    if isinstance(getattr(probe, "router_jitter_noise", None), float):
        # phimoe's sparsemixer threshold wide enough that several experts share a softmax, so that its formula
        # shows (other blocks use the key in training only)
        probe.router_jitter_noise = 0.5
    probe.num_hidden_layers = 1
    probe.dtype = torch.float32
    probe._experts_implementation = "eager"    # the experts' own loop, not a hub kernel
    return probe


def _capture_routing(block, x):
    """(expert indices [T, K], weights [T, K], output) as the block hands them to its experts."""
    import torch

    seen = {}
    experts = block.experts

    def hook(module, args, kwargs):
        names = ("hidden_states", "top_k_index", "top_k_weights")
        values = dict(zip(names, args)) | {k: v for k, v in kwargs.items()}
        index = values.get("top_k_index", values.get("router_indices"))
        weights = values.get("top_k_weights", values.get("routing_weights"))
        seen["index"], seen["weights"] = index, weights
        seen["only_hidden"] = len(args) + len(kwargs) == 1
        if seen["only_hidden"]:
            seen["hidden"] = (args or tuple(kwargs.values()))[0]

    handle = experts.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            out = block(x)
    finally:
        handle.remove()
    if seen.get("only_hidden"):
        scales = input_scales(x.reshape(-1, x.shape[-1]), seen.get("hidden"))
        if scales is not None:
            # llama4's: every expert on every token, its input the hidden state times the token's weight for it (0
            # for an expert not chosen): the chosen experts and their weights, as the gating hands them on
            k = int((scales != 0).sum(-1).max())
            weights, index = scales.topk(k, dim=-1)
            return index, weights, out[0] if isinstance(out, tuple) else out, True
        raise NotNative("moe", f"{type(block).__name__} calls its experts with the hidden states alone (no expert "
                               "indices / weights: it routes outside them, e.g. the router's scores scaling the "
                               "inputs), which no part writes")
    if "index" not in seen or seen["index"] is None:
        raise NotNative("moe", f"{type(block).__name__} does not call its experts with (hidden, indices, weights)")
    return seen["index"], seen["weights"], out[0] if isinstance(out, tuple) else out, False


def input_scales(x, routed_in):
    """[tokens, experts]: the scalar each token's hidden state is multiplied by as each expert's input, where the
    experts' input `routed_in` is every token's hidden state once per expert, each times a scalar (llama4's router
    scores scaling the inputs), the same count of experts per token not 0; None for another input."""
    import torch

    if not isinstance(routed_in, torch.Tensor) or routed_in.dim() != 2 or routed_in.shape[0] % x.shape[0]:
        return None
    rows = routed_in.detach().float().reshape(-1, *x.shape)           # [experts, tokens, hidden]
    scale = (rows * x.float()).sum(-1) / (x.float() * x.float()).sum(-1)
    if not torch.allclose(rows, scale[..., None] * x.float(), atol=1e-5, rtol=1e-4):
        return None
    counts = (scale.abs() > 0).sum(0)
    return scale.t() if bool((counts == counts[0]).all()) and int(counts[0]) > 0 else None


def _router_logits(router, x):
    import torch

    weight = router.weight
    bias = getattr(router, "bias", None)
    with torch.no_grad():
        return torch.nn.functional.linear(x.to(weight.dtype), weight, bias if isinstance(bias, torch.Tensor) else None)


def selection(logits, *, scoring, selection_bias=None, n_group=1, topk_group=1, group_select="top2_sum",
              select_on_logits=False):
    """(scores, choice) in fp32: the gate's scores of every expert, and what the top-k picks by (the
    scores plus the selection bias, experts outside the kept groups at -inf; `select_on_logits`: the logits plus
    the bias, kolibri1's)."""
    import torch

    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    picked_by = logits if select_on_logits else scores
    choice = picked_by + selection_bias.float() if selection_bias is not None else picked_by
    if n_group > 1:
        grouped = choice.view(choice.shape[0], n_group, -1)
        group_scores = grouped.amax(-1) if group_select == "max" else grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(choice.shape[0], -1)
    return scores, choice


def reference_gating(logits, *, k, scoring, renormalize, selection_bias=None, n_group=1, topk_group=1,
                     group_select="top2_sum", routed_scaling_factor=1.0, index=None, select_on_logits=False):
    """The gatings the generated code expresses, in plain torch (fp32): (weights [T, k], indices [T, k]);
    `index`: these experts rather than the top-k (their weights by the same formula)."""
    scores, choice = selection(logits, scoring=scoring, selection_bias=selection_bias, n_group=n_group,
                               topk_group=topk_group, group_select=group_select, select_on_logits=select_on_logits)
    if index is None:
        index = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, index.long())
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    return weights * routed_scaling_factor, index


def sparsemixer(logits, jitter_eps: float):
    """phimoe's sparsemixer at inference, in plain torch (fp32): (weights [T, 2], indices [T, 2]). Each of two
    rounds takes the best expert left, its weight the softmax over the experts within a relative 2 x jitter_eps of
    it (|best - logit| / max(|logit|, best)); the first round's expert is out of the second. Not renormalised."""
    import torch

    logits = logits.float()
    left, weights, index = logits, [], []
    for _ in range(2):
        best, chosen = left.max(dim=-1, keepdim=True)
        far = (best - logits) / logits.abs().clamp(min=best) > 2 * jitter_eps
        weights.append(left.masked_fill(far, float("-inf")).softmax(dim=-1).gather(-1, chosen))
        index.append(chosen)
        left = left.scatter(-1, chosen, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(index, dim=-1)


def _same_routing(index_a, weights_a, index_b, weights_b) -> bool:
    import torch

    order_a, order_b = index_a.sort(-1), index_b.sort(-1)
    if not torch.equal(order_a.values.long(), order_b.values.long()):
        return False
    wa = weights_a.float().gather(1, order_a.indices)
    wb = weights_b.float().gather(1, order_b.indices)
    return torch.allclose(wa, wb, rtol=1e-5, atol=1e-6)


SCALING_KEYS = ("routed_scaling_factor", "router_scaling_factor", "route_scale")
SHARED_COUNT_KEYS = ("n_shared_experts", "moe_num_shared_experts", "num_shared_experts")


def selection_bias(block, router_name: str):
    """(the selection bias tensor, its name relative to the block) where the block has one: the router's
    e_score_correction_bias, the block's own (hy_v3), or the router's moe_statics' (ernie4_5_moe, [1, E]), or the
    block's expert_bias (afmoe); None."""
    import torch

    for name in (f"{router_name}.e_score_correction_bias", "e_score_correction_bias",
                 f"{router_name}.moe_statics.e_score_correction_bias", "expert_bias"):
        owner, _, attribute = name.rpartition(".")
        try:
            tensor = getattr(block.get_submodule(owner) if owner else block, attribute, None)
        except AttributeError:
            continue
        if isinstance(tensor, torch.Tensor):
            return tensor, name
    return None


def _scaling(config) -> tuple[str | None, float | None]:
    """(the config key of the routed weights' scaling factor, its value) where the config has one other than 1."""
    for key in SCALING_KEYS:
        factor = getattr(config, key, None)
        if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor != 1:
            return key, float(factor)
    return None, None


def refuse_extra_scored(block, config, scored: int) -> None:
    """NotNative where the router scores more experts than the block routes to (inkling's router: its shared experts'
    logits normalised with the chosen routed ones', their weights the shared experts' gammas): every gating here
    scores the routed experts alone (and its selection bias, one per routed expert, would not add to the scores)."""
    down = getattr(block.experts, "down_proj", None)
    routed = getattr(block.experts, "num_experts", None) or (down.shape[0] if getattr(down, "ndim", 0) == 3 else None)
    if not isinstance(routed, int) or scored == routed:
        return
    shared = next((f"; config.{key} is {scored - routed}" for key in SHARED_COUNT_KEYS
                   if getattr(config, key, None) == scored - routed), "")
    raise NotNative("moe", f"the router scores {scored} experts and the block routes to {routed}{shared}: the extra "
                           "ones' scores (shared experts weighted by the router) no gating writes")


def _probe_gating(block, router, config, hidden: int) -> dict:
    """The candidate gating that routes as the block does (one, or NotNative)."""
    import torch

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(24, hidden, generator=gen)
    router_name = next(n for n in ROUTER_NAMES if getattr(block, n, None) is not None and router in
                       (getattr(block, n), *getattr(block, n).children()))
    found = selection_bias(block, router_name)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        if found is not None:     # large enough to change which experts are chosen
            found[0].copy_(torch.rand(found[0].shape, generator=gen) * 0.5)
    index, weights, _, input_scaled = _capture_routing(block, x[None])
    index, weights = index.reshape(x.shape[0], -1), weights.reshape(x.shape[0], -1)
    logits = _router_logits(router, x)
    refuse_extra_scored(block, config, logits.shape[-1])
    k = index.shape[-1]
    has_bias = found is not None
    n_group = int(getattr(config, "n_group", None) or 1)
    topk_group = int(getattr(config, "topk_group", None) or 1)
    _, factor = _scaling(config)
    matches = []
    for scoring in ("softmax", "sigmoid"):
        for renormalize in (True, False):
            for group_select in (("top2_sum", "max") if n_group > 1 else ("top2_sum",)):
                for scaled in ((True, False) if isinstance(factor, (int, float)) and factor != 1 else (False,)):
                    w, i = reference_gating(logits, k=k, scoring=scoring, renormalize=renormalize,
                                            selection_bias=found[0].reshape(-1) if has_bias else None,
                                            n_group=n_group, topk_group=topk_group, group_select=group_select,
                                            routed_scaling_factor=float(factor) if scaled else 1.0)
                    if _same_routing(index, weights, i, w):
                        matches.append(dict(scoring=scoring, renormalize=renormalize, groups=n_group > 1,
                                            group_select=group_select, routed_scaling=scaled, selection_bias=has_bias))
    plain = dict(groups=False, group_select="top2_sum", routed_scaling=False, select_on_logits=False)
    if not matches and has_bias and n_group == 1:
        # the selection bias added to the router's logits rather than its scores (kolibri1)
        for scoring in ("sigmoid", "softmax"):
            for renormalize in (True, False):
                w, i = reference_gating(logits, k=k, scoring=scoring, renormalize=renormalize,
                                        selection_bias=found[0].reshape(-1), select_on_logits=True)
                if _same_routing(index, weights, i, w):
                    matches.append({**plain, "scoring": scoring, "renormalize": renormalize, "selection_bias": True,
                                    "select_on_logits": True})
    jitter = getattr(config, "router_jitter_noise", None)
    if not matches and not has_bias and k == 2 and isinstance(jitter, (int, float)) and not isinstance(jitter, bool):
        w, i = sparsemixer(logits, float(jitter))
        if _same_routing(index, weights, i, w):
            matches.append({**plain, "scoring": "sparsemixer", "renormalize": False, "selection_bias": False})
    if not matches:
        raise NotNative("moe", f"{type(block).__name__} routes by no gating the NPU ops or the plain-torch gate "
                               "express (softmax / sigmoid, selection bias on the scores or the logits, grouped top-k, "
                               "renormalised, scaled; phimoe's sparsemixer)")
    gating = {**matches[0], "input_scaled": input_scaled}
    if gating["scoring"] == "sigmoid" and not has_bias and _picks_by_logits(block, router, x, k):
        gating["select_on_logits"] = True
    # input_scaled: the weights multiply each chosen expert's input, not its output (llama4's)
    return gating


SATURATING_GAIN = 64.0      # router weights times this: many logits past 17, where float32's sigmoid rounds to 1


def _picks_by_logits(block, router, x, k: int) -> bool:
    """Whether a sigmoid router without a selection bias takes its top-k of the logits rather than of the sigmoid
    scores (llama4's Llama4Router: top-k, then the sigmoid). One in exact arithmetic, but large logits' sigmoids round
    to one tie at 1, and a top-k of the scores then picks among the tied: read with the router's weights scaled until
    the two choices differ; False where they do not (nothing to tell them apart)."""
    import torch

    saved = router.weight.detach().clone()
    try:
        with torch.no_grad():
            router.weight.mul_(SATURATING_GAIN)
        logits = _router_logits(router, x)
        by_logits = reference_gating(logits, k=k, scoring="sigmoid", renormalize=False, select_on_logits=True)
        # the rows whose every chosen weight is above 0: a chosen expert whose sigmoid underflows to 0 in float32 (a
        # top-k past 1, its logit far below) is not told from one not chosen where the weights scale the experts'
        # inputs (llama4's)
        keep = (by_logits[0] > 0).all(-1)
        x, logits = x[keep], logits[keep]
        by_logits = reference_gating(logits, k=k, scoring="sigmoid", renormalize=False, select_on_logits=True)
        by_scores = reference_gating(logits, k=k, scoring="sigmoid", renormalize=False)
        if _same_routing(by_logits[1], by_logits[0], by_scores[1], by_scores[0]):
            return False
        index, weights, _, _ = _capture_routing(block, x[None])
    finally:
        with torch.no_grad():
            router.weight.copy_(saved)
    index, weights = index.reshape(x.shape[0], -1), weights.reshape(x.shape[0], -1)
    return _same_routing(index, weights, by_logits[1], by_logits[0])


def _scaled_after_experts(block, config, shared_name: str) -> bool:
    """Whether the block multiplies its routed experts' output by the config's routed scaling factor after them
    (minimax_m3: the weights handed to the experts unscaled, so the gating's candidates do not show it): the block's
    output against its experts' with the shared experts zeroed."""
    import torch

    _, factor = _scaling(config)
    if factor is None:
        return False
    shared = getattr(block, shared_name, None)
    saved = [(p, p.detach().clone()) for p in shared.parameters()] if shared is not None else []
    seen = {}
    handle = block.experts.register_forward_hook(lambda module, args, out: seen.__setitem__("out", out))
    x = torch.randn(1, 7, PROBE_HIDDEN, generator=torch.Generator().manual_seed(18))
    try:
        with torch.no_grad():
            for p, _ in saved:
                p.zero_()
            got = block(x)
    finally:
        handle.remove()
        with torch.no_grad():
            for p, value in saved:
                p.copy_(value)
    got = got[0] if isinstance(got, tuple) else got
    routed = seen.get("out")
    if not isinstance(routed, torch.Tensor) or routed.numel() != got.numel():
        return False
    routed = routed.reshape(got.shape)
    return not torch.allclose(got, routed, rtol=1e-4, atol=1e-5) and \
        torch.allclose(got, factor * routed, rtol=1e-4, atol=1e-5)


def _probe_experts(experts, config, hidden: int, input_scaled: bool = False) -> tuple[str, str, str]:
    """(experts kind, activation, gate_up layout) from one expert's output against the candidates (`input_scaled`:
    experts called with the hidden states alone, once per expert)."""
    import torch
    from transformers.activations import ACT2FN

    gen = torch.Generator().manual_seed(12)
    gate_up = experts.gate_up_proj
    layout = "E,2I,H" if gate_up.shape[-1] == hidden else "E,H,2I"
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 2)
    x = torch.randn(5, hidden, generator=gen)
    index = torch.zeros(5, 1, dtype=torch.long)
    weights = torch.ones(5, 1)
    with torch.no_grad():
        if input_scaled:
            # experts that take every expert's rows stacked (llama4's): expert 0's rows x, the others' 0
            stacked = torch.zeros(gate_up.shape[0], *x.shape)
            stacked[0] = x
            got = experts(stacked.reshape(-1, hidden)).reshape(gate_up.shape[0], *x.shape)[0]
        else:
            got = experts(x, index, weights)
    w13 = gate_up[0] if layout == "E,H,2I" else gate_up[0].t()         # [H, 2I]
    down = experts.down_proj[0]
    w2 = down if down.shape[-1] == hidden else down.t()                 # [I, H]
    b13 = getattr(experts, "gate_up_proj_bias", None)
    b2 = getattr(experts, "down_proj_bias", None)
    candidates = {}
    act = getattr(experts, "act_fn", None) or ACT2FN[getattr(config, "hidden_act", "silu")]
    g, u = (x @ w13).chunk(2, dim=-1)
    candidates[("gmm", "swiglu")] = (act(g) * u) @ w2
    limit, alpha = getattr(experts, "limit", None), getattr(experts, "alpha", None)
    if b13 is not None and b2 is not None and limit is not None and alpha is not None:
        y = x @ w13 + b13[0]
        g, u = y[..., ::2].clamp(max=limit), y[..., 1::2].clamp(-limit, limit)
        candidates[("biased_interleaved", "clamped_swiglu")] = ((u + 1) * g * torch.sigmoid(g * alpha)) @ w2 + b2[0]
    clamp = _clamp_of(experts, config)
    if b13 is None and b2 is None and clamp is not None:
        # the clamped swiglu over gate / up halves, no biases (minimax_m3)
        candidates[("gmm", "clamped_swiglu_halves")] = _clamped_halves(x @ w13, *clamp) @ w2
    for (kind, activation), want in candidates.items():
        if torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            if activation == "swiglu" and gelu_tanh(act):
                return kind, "geglu_tanh", layout          # gemma4's experts: npu_geglu
            if activation == "swiglu" and getattr(act, "__name__", type(act).__name__).lower() not in ("silu", "siluactivation") \
                    and not isinstance(act, torch.nn.SiLU):
                raise NotNative("moe", f"expert activation {type(act).__name__}: npu_swiglu computes silu only")
            return kind, activation, layout
    raise NotNative("moe", f"{type(experts).__name__} computes none of: gate/up halves with silu (npu_swiglu), "
                           "gpt_oss's interleaved clamped swiglu with biases, that swiglu over halves without biases")


def gelu_tanh(act) -> bool:
    """Whether the activation is gelu's tanh form (transformers' gelu_pytorch_tanh), read on values across its bend."""
    import torch

    t = torch.linspace(-6, 6, 97)
    with torch.no_grad():
        return torch.allclose(act(t), torch.nn.functional.gelu(t, approximate="tanh"), rtol=1e-5, atol=1e-6)


def _clamp_of(module, config) -> tuple[float, float] | None:
    """(limit, alpha) of a module's clamped swiglu where they are the config's swiglu_limit / swiglu_alpha (alpha
    transformers' 1.702 where the config has none), the code's reading of them; None otherwise."""
    limit = getattr(module, "swiglu_limit", getattr(module, "limit", None))
    alpha = getattr(module, "swiglu_alpha", getattr(module, "alpha", None))
    if limit is None or alpha is None or limit != getattr(config, "swiglu_limit", None) \
            or alpha != getattr(config, "swiglu_alpha", 1.702):
        return None
    return float(limit), float(alpha)


def _clamped_halves(gate_up, limit: float, alpha: float):
    import torch

    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def _check_clamped_shared(block, name: str, config, hidden: int) -> None:
    """The shared experts compute down(clamped swiglu of their gate_up halves), as the clamped routed experts do."""
    import torch

    shared = getattr(block, name)
    linears = dict(shared.named_children())
    clamp = _clamp_of(shared, config)
    if clamp is None or set(linears) != {"gate_up_proj", "down_proj"}:
        raise NotNative("moe", f"shared experts {type(shared).__name__} beside clamped-swiglu experts: not gate_up / "
                               "down with the config's swiglu_limit / swiglu_alpha")
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(16)) * 4
    with torch.no_grad():
        got, want = shared(x), linears["down_proj"](_clamped_halves(linears["gate_up_proj"](x), *clamp))
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise NotNative("moe", f"shared experts {type(shared).__name__} compute no down(clamped swiglu(gate_up))")


# the shared experts' width as the config gives it: one expert's width times their count, or a key of its own
SHARED_WIDTH_EXPRESSIONS = (
    "config.moe_intermediate_size * config.n_shared_experts", "config.shared_expert_intermediate_size",
    "config.intermediate_size", "config.shared_intermediate_size",
    *(f"config.{unit} * config.{count}" for unit in ("moe_intermediate_size", "intermediate_size")
      for count in SHARED_COUNT_KEYS if (unit, count) != ("moe_intermediate_size", "n_shared_experts")),
    # one shared expert's width of its own times their count (dots3_note)
    *(f"config.shared_experts_intermediate_size * config.{count}" for count in SHARED_COUNT_KEYS))


def _probe_shared(block, config, hidden: int) -> tuple[str, str, str]:
    """(kind, attribute, width expression) of the block's shared experts."""
    import torch

    for name in SHARED_NAMES:
        shared = getattr(block, name, None)
        if shared is None:
            continue
        gated = getattr(block, f"{name}_gate", None) is not None
        act = getattr(shared, "act_fn", None)
        if act is not None and not isinstance(act, torch.nn.SiLU) \
                and getattr(act, "__name__", type(act).__name__).lower() not in ("silu", "siluactivation"):
            raise NotNative("moe", f"shared experts' activation {type(act).__name__}: npu_swiglu computes silu only")
        width = shared.down_proj.weight.shape[-1]
        for expr in SHARED_WIDTH_EXPRESSIONS:
            try:
                if eval(expr, {"config": config}) == width:    # noqa: S307 - our own fixed expressions
                    return ("gated" if gated else "plain"), name, expr
            except (AttributeError, TypeError):
                continue
        raise NotNative("moe", f"shared experts of width {width}: no config expression gives it")
    return None, "shared_experts", "0"



def shared_bias(config, block_cls, block, shared_name: str):
    """The shared experts' projections' biases: Expr(config.<key>) where toggling a dense MLP's bias key
    (SHARED_BIAS_KEYS: deepseek_v2's mlp_bias, ernie4_5_moe's use_bias, whose shared experts are the dense
    MLP's class) gives or takes them, else whether the block built on the config has them."""
    import torch

    def has_bias(built) -> bool:
        shared = getattr(built, shared_name, None)
        return isinstance(getattr(getattr(shared, "down_proj", None), "bias", None), torch.Tensor)

    present = has_bias(block)
    for key in SHARED_BIAS_KEYS:
        value = getattr(config, key, None)
        if not isinstance(value, bool) or value != present:
            continue
        toggled = copy.deepcopy(config)
        setattr(toggled, key, not value)
        try:
            _, other, _ = _probe_block(toggled, block_cls)
        except NotNative:
            continue
        if has_bias(other) != present:
            return Expr(f"config.{key}")
    return present


def shared_width_without_count(config, block_cls, shared_name: str, expr: str) -> str | None:
    """The config key of the width transformers gives the block's shared experts where the checkpoint's config sets
    their count to 0 (hy_v3: `moe_intermediate_size * num_shared_experts or intermediate_size`, a shared MLP of the
    dense width all the same), read off the block built with that count; None where it builds none (or a width of 0)
    or the width is not a count times a unit."""
    if "*" not in expr:
        return None
    count_key = expr.split("*")[1].strip()[len("config."):]
    zero = copy.deepcopy(config)
    setattr(zero, count_key, 0)
    try:
        probe, block, _ = _probe_block(zero, block_cls)
    except NotNative:
        return None
    shared = getattr(block, shared_name, None)
    width = getattr(getattr(shared, "down_proj", None), "weight", None)
    if width is None or not width.shape[-1]:
        return None
    for candidate in SHARED_WIDTH_EXPRESSIONS:
        if "*" in candidate:
            continue
        try:
            if eval(candidate, {"config": probe}) == width.shape[-1]:    # noqa: S307 - our own fixed expressions
                return candidate[len("config."):]
        except (AttributeError, TypeError):
            continue
    raise NotNative("moe", f"shared experts of width {width.shape[-1]} where their count {count_key} is 0: no config "
                           "key gives it")


def fused_shared_linears(shared) -> tuple[str, str] | None:
    """(gate/up, down) child names of a shared MLP of two bias-free linears, gate and up fused as halves of the
    first (granitemoeshared's input_linear / output_linear); None for any other shape."""
    import torch

    linears = {name: m for name, m in shared.named_children() if isinstance(m, torch.nn.Linear)}
    if len(linears) != 2 or any(m.bias is not None for m in linears.values()):
        return None
    (a, la), (b, lb) = linears.items()
    for (gu, g), (down, d) in (((a, la), (b, lb)), ((b, lb), (a, la))):
        if g.out_features == 2 * d.in_features and d.out_features == g.in_features:
            return gu, down
    return None


def layer_shared_mlp(config):
    """(its attribute in the layer, its class) of a shared MLP the decoder layer holds beside its sparse-MoE block
    (granitemoeshared's shared_mlp), None where the layers have none: read on the shrunk probe config, whose
    shared width is not 0 where the config has the key (a checkpoint of the family may have them where this
    config's width is 0)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_probe_config(config))
    for layer in getattr(getattr(model, "model", None), "layers", None) or []:
        if moe_block(layer) is None:
            continue
        for name in LAYER_SHARED_NAMES:
            if getattr(layer, name, None) is not None:
                return name, type(getattr(layer, name))
    return None


def layer_shared_renames(config) -> tuple[tuple[str, str], ...]:
    """The checkpoint's names of the layer's shared MLP as the block's shared experts (agent.recipe.native.parts.model
    adds them to the file's renames); () where the layers hold none beside their sparse-MoE block."""
    found = layer_shared_mlp(config)
    if found is None:
        return ()
    name, cls = found
    linears = fused_shared_linears(cls(_probe_config(config)))
    if linears is None:
        return ()       # the sparse-MoE part refuses it
    return tuple((f"\\.{name}\\.{stored}\\.", f".mlp.shared_experts.{native}.")
                 for stored, native in zip(linears, ("gate_up_proj", "down_proj")))


def _probe_layer_shared(config, probe, hidden: int) -> tuple[str, str, str] | None:
    """The layer's own shared MLP, added to the block's output on the same input (granitemoeshared): read as the
    block's shared experts (the checkpoint's names renamed to them: agent.recipe.native.parts.model) where it is
    down(silu(gate) * up) with gate / up the halves of one linear, its width a config expression."""
    import torch
    import torch.nn.functional as F

    found = layer_shared_mlp(config)
    if found is None:
        return None
    name, cls = found
    shared = cls(probe).float().eval()
    linears = fused_shared_linears(shared)
    if linears is None:
        raise NotNative("moe", f"the layer's {name} is not two linears with gate / up fused as halves")
    gate_up, down = (getattr(shared, n) for n in linears)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(5, hidden, generator=gen)
    with torch.no_grad():
        for p in shared.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
        g, u = gate_up(x).chunk(2, dim=-1)
        if not torch.allclose(shared(x), down(F.silu(g) * u), rtol=1e-4, atol=1e-4):
            raise NotNative("moe", f"the layer's {name} computes no down(silu(gate) * up) of its fused halves")
    width = down.in_features
    for expr in SHARED_WIDTH_EXPRESSIONS:
        try:
            if eval(expr, {"config": probe}) == width:    # noqa: S307 - our own fixed expressions
                return "plain", "shared_experts", expr
        except (AttributeError, TypeError):
            continue
    raise NotNative("moe", f"the layer's {name} of width {width}: no config expression gives it")


def _plain_path(pattern: str) -> tuple[str, ...] | None:
    """A conversion rule's pattern as module names ("\\.mlp\\.gate" -> ("mlp", "gate")); None for a regex
    that is more than a dotted name."""
    text = pattern.replace("\\.", ".").strip("^$").strip(".")
    parts = tuple(text.split("."))
    return parts if all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", p) for p in parts) else None



def _first_line(exc: Exception, limit: int = 160) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _probe_block(config, block_cls):
    """(the shrunk probe config, the block built on it, its router's attribute name)."""
    import torch

    probe = _probe_config(config)
    torch.manual_seed(0)
    try:
        block = block_cls(probe).float().eval()
    except Exception as exc:  # noqa: BLE001 - a block built from more than the config (a layer index, ...)
        raise NotNative("moe", f"{block_cls.__name__}(config) cannot be built on its own ({_first_line(exc)})") from exc
    router_name = router_path(block, getattr(probe, _config_key(probe, EXPERT_COUNT_KEYS, "routed expert count")))
    if router_name is None:
        raise NotNative("moe", f"{block_cls.__name__} has no gate / router with a weight")
    return probe, block, router_name


def _logits_in_fp32(router) -> bool:
    """Whether a bfloat16 router computes its logits in float32 all the same (kolibri1's casts its weight and input
    up): the native router then holds its weight in float32 (the checkpoint's, exactly) and takes a float32 input."""
    import torch

    gen = torch.Generator().manual_seed(14)
    weights = [p for p in router.parameters() if p.dim() == 2]
    if len(weights) != 1:
        return False
    x = torch.randn(16, PROBE_HIDDEN, generator=gen).to(torch.bfloat16)
    try:
        with torch.no_grad():
            weights[0].copy_(torch.randn(weights[0].shape, generator=gen))
            out = router(x)
    except Exception:  # noqa: BLE001 - a router that takes more than the hidden states (afmoe's expert bias)
        return False
    logits = out[0] if isinstance(out, tuple) else out
    if not isinstance(logits, torch.Tensor) or logits.dtype != torch.float32 or logits.shape[-1] != weights[0].shape[0]:
        return False
    # computed in float32, not a bfloat16 product cast up afterwards (granitemoe's)
    with torch.no_grad():
        exact = torch.nn.functional.linear(x.float(), weights[0].float())
        rounded = torch.nn.functional.linear(x, weights[0]).float()
    return float((logits - exact).abs().max()) * 10 < float((rounded - exact).abs().max())


def router_path(block, experts: int) -> str | None:
    """The router's path in the block: its gate / router with a weight, or the one linear to `experts` outputs
    such a module holds (hunyuan_v1_moe's gate.wg); None where it has neither."""
    import torch

    for name in ROUTER_NAMES:
        module = getattr(block, name, None)
        if module is None:
            continue
        if getattr(module, "weight", None) is not None:
            return name
        linears = [child for child, m in module.named_children()
                   if isinstance(m, torch.nn.Linear) and m.out_features == experts]
        if len(linears) == 1:
            return f"{name}.{linears[0]}"
    return None


def gating_of(config) -> dict:
    """How `config`'s sparse-MoE blocks route, probed as derive_moe probes it: {"block_name", "router_name",
    "k", "scoring", "renormalize", "selection_bias", "groups", "group_select", "routed_scaling",
    "n_group", "topk_group", "routed_scaling_factor"} (NotNative: a routing none of the candidates is)."""
    blocks = _sparse_blocks(config)
    if blocks is None:
        raise NotNative("moe", "no layer has a sparse-MoE block with fused 3-D expert weights")
    block_name, block_cls, _ = blocks
    probe, block, path = _probe_block(config, block_cls)
    gating = _probe_gating(block, block.get_submodule(path), probe, PROBE_HIDDEN)
    _, factor = _scaling(config)
    return {**gating, "block_name": block_name, "router_name": path.split(".")[0], "router_path": path,
            "k": _top_k(config),
            "n_group": int(getattr(config, "n_group", None) or 1), "topk_group": int(getattr(config, "topk_group", None) or 1),
            "routed_scaling_factor": float(factor) if gating["routed_scaling"] else 1.0}



def _sparse_blocks(config):
    """(block attribute, block class, sparse flags per layer) of `config`'s model, built on the meta device
    (every layer, no memory); None when no layer has such a block."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    except Exception as exc:  # noqa: BLE001 - a class transformers cannot build here
        raise NotNative("moe", f"transformers cannot build it as a causal LM ({_first_line(exc)})") from exc
    layers = list(getattr(getattr(model, "model", None), "layers", None) or [])
    blocks = [moe_block(layer) for layer in layers]
    sparse = [b is not None for b in blocks]
    if not any(sparse):
        return None
    names = {b[0] for b in blocks if b is not None}
    classes = {type(b[1]) for b in blocks if b is not None}
    if len(names) != 1 or len(classes) != 1:
        raise NotNative("moe", f"MoE blocks of several kinds: {sorted(names)} {sorted(c.__name__ for c in classes)}")
    return names.pop(), classes.pop(), sparse




# ---- which layers are sparse: the config key transformers decides it by ------------------------------------
def _predicted(config, rule: str, n: int) -> list[bool] | None:
    """The sparse layers `rule` gives on `config` (None: the config does not state the rule's keys)."""
    if rule in ("first_k_dense_replace", "num_dense_layers"):
        k = getattr(config, rule, None)
        return [i >= k for i in range(n)] if isinstance(k, int) else None
    if rule == "mlp_layer_types":
        types = getattr(config, "mlp_layer_types", None)
        return [t == "sparse" for t in types[:n]] if isinstance(types, (list, tuple)) and len(types) >= n else None
    if rule == "moe_layer_interval":
        keys = ("moe_layer_interval", "moe_layer_start_index", "moe_layer_end_index")
        interval, start, end = (getattr(config, key, None) for key in keys)
        if all(isinstance(v, int) for v in (interval, start, end)) and interval > 0:
            return [(i + 1) % interval == 0 and start <= i <= end for i in range(n)]
        return None
    if rule == "decoder_sparse_step":
        step, only = getattr(config, "decoder_sparse_step", None), getattr(config, "mlp_only_layers", None)
        if isinstance(step, int) and step > 0:
            return [i not in (only or []) and (i + 1) % step == 0 for i in range(n)]
    if rule == "expert_layer_period":
        period, offset = getattr(config, "expert_layer_period", None), getattr(config, "expert_layer_offset", None)
        if isinstance(period, int) and isinstance(offset, int) and period > 0:
            return [i % period == offset for i in range(n)]
    return None


LAYOUT_RULES = ("first_k_dense_replace", "num_dense_layers", "mlp_layer_types", "decoder_sparse_step",
                "moe_layer_interval", "expert_layer_period")


def _layout_toggles(rule: str, n: int) -> list[dict]:
    """Config changes (on a copy of LAYOUT_LAYERS layers) under which `rule` must still give transformers' layers."""
    if rule in ("first_k_dense_replace", "num_dense_layers"):
        return [{rule: 2}, {rule: 0}]
    if rule == "mlp_layer_types":
        return [{"mlp_layer_types": ["dense", "sparse"] * (n // 2)}]
    if rule == "moe_layer_interval":
        return [{"moe_layer_interval": 1, "moe_layer_start_index": 1, "moe_layer_end_index": n - 1},
                {"moe_layer_interval": 2, "moe_layer_start_index": 0, "moe_layer_end_index": n - 2}]
    if rule == "expert_layer_period":
        # jamba's: every expert_layer_period-th layer from expert_layer_offset
        return [{"expert_layer_period": 2, "expert_layer_offset": 0}, {"expert_layer_period": 3, "expert_layer_offset": 2}]
    return [{"decoder_sparse_step": 2, "mlp_only_layers": []}, {"decoder_sparse_step": 1, "mlp_only_layers": [1]}]


def _short(config, changes: dict):
    """A copy of `config` with LAYOUT_LAYERS layers (its per-layer lists made as long) and `changes`."""
    short = copy.deepcopy(config)
    total = short.num_hidden_layers
    for key, value in list(vars(short).items()):
        if isinstance(value, list) and len(value) == total and total:
            # cut to LAYOUT_LAYERS, or repeated up to them (a config of fewer layers)
            setattr(short, key, (value * -(-LAYOUT_LAYERS // total))[:LAYOUT_LAYERS])
    short.num_hidden_layers = LAYOUT_LAYERS
    for key, value in changes.items():
        setattr(short, key, value)
    return short


def sparse_layout(config, sparse: list[bool]) -> str:
    """The config key that decides which layers are sparse (their rule reproduces transformers' choice on the
    checkpoint's config and on copies with the key changed), or "all" where no key does and every layer is."""
    n = len(sparse)
    for rule in LAYOUT_RULES:
        if _predicted(config, rule, n) != sparse:
            continue
        held = True
        for changes in _layout_toggles(rule, LAYOUT_LAYERS):
            short = _short(config, changes)
            try:
                blocks = _sparse_blocks(short)
            except NotNative:
                held = False
                break
            got = blocks[2] if blocks is not None else [False] * LAYOUT_LAYERS
            if _predicted(short, rule, LAYOUT_LAYERS) != got:
                held = False
                break
        if held:
            return rule
    if all(sparse):
        return "all"
    raise NotNative("moe", f"sparse layers {[i for i, s in enumerate(sparse) if s]} follow none of "
                           f"{', '.join(LAYOUT_RULES)} as the config states them")


DENSE_LAYER = {"first_k_dense_replace": {"first_k_dense_replace": 1}, "num_dense_layers": {"num_dense_layers": 1},
               "decoder_sparse_step": {"decoder_sparse_step": 1, "mlp_only_layers": [0]},
               "moe_layer_interval": {"moe_layer_interval": 1, "moe_layer_start_index": 1},
               "expert_layer_period": {"expert_layer_period": 2, "expert_layer_offset": 1}}


def dense_layer_changes(rule: str, config) -> dict | None:
    """Config changes that make layer 0 dense (the dense MLP's code is probed on it); None: no layer ever is. A
    per-layer list is changed at its first entry only (the probe's shrunk copy cuts it to its layers)."""
    if rule == "mlp_layer_types":
        return {"mlp_layer_types": ["dense"] + list(config.mlp_layer_types[1:])}
    return DENSE_LAYER.get(rule)


# ---- the checkpoint's per-expert names ----------------------------------------------------------------------
def checkpoint_expert_names(model_type: str) -> tuple[str, ...]:
    """(gate, up, down) per-expert names of the checkpoint from transformers' conversion mapping; () where the
    checkpoint stores the fused tensors."""
    from transformers import conversion_mapping

    names = ()
    for rule in conversion_mapping.get_checkpoint_conversion_mapping(model_type) or []:
        sources, targets = list(rule.source_patterns), list(rule.target_patterns)
        if type(rule).__name__ == "WeightRenaming" or not all("experts.*." in src for src in sources):
            continue          # renames: the skeleton's (agent.recipe.native.parts.model)
        if any(t.endswith("experts.gate_up_proj") for t in targets) and len(sources) == 2:
            gate, up = (src.split("experts.*.", 1)[1].rsplit(".weight", 1)[0] for src in sources)
            names = (gate, up) + names[2:] if len(names) == 3 else (gate, up)
        elif any(t.endswith("experts.down_proj") for t in targets) and len(sources) == 1:
            down = sources[0].split("experts.*.", 1)[1].rsplit(".weight", 1)[0]
            names = (*names[:2], down) if len(names) >= 2 else names + (down,)
        else:
            raise NotNative("moe", f"transformers merges {sources} into {targets} for {model_type}: not the "
                                   "experts' gate/up and down")
    if names and len(names) != 3:
        raise NotNative("moe", f"transformers' conversion mapping for {model_type} names {names} for the experts")
    return tuple(names)


def fused_experts_renamed(model_type: str) -> bool:
    """Whether the checkpoint stores the experts as transformers' fused 3-D tensors under other names, which
    transformers' conversion mapping renames to experts.gate_up_proj and experts.down_proj (granitemoe's
    input_linear / output_linear, aria's fc1 / fc2): the block's loader splits them, the renames are the skeleton's."""
    from transformers import conversion_mapping

    targets = {target.replace("\\.", ".").rsplit(".", 2)[-2:][-1] for rule in
               conversion_mapping.get_checkpoint_conversion_mapping(model_type) or []
               if type(rule).__name__ == "WeightRenaming" for target in rule.target_patterns
               if target.replace("\\.", ".").endswith(("experts.gate_up_proj", "experts.down_proj"))}
    return targets == {"gate_up_proj", "down_proj"}


def fused_experts_as_built(model_type: str) -> bool:
    """Whether the checkpoint stores the experts as the fused 3-D tensors transformers builds (granitemoe_swa):
    transformers converts none of the type's checkpoint names, so it loads them as its module holds them."""
    from transformers import conversion_mapping

    return not conversion_mapping.get_checkpoint_conversion_mapping(model_type)


def fused_experts_stored(model_type: str) -> bool:
    """Whether transformers' conversion mapping for `model_type` converts the linear-attention tensors its
    checkpoints store otherwise (agent.recipe.native.parts.linear_attention) and leaves the experts alone: its
    checkpoints hold the fused 3-D experts as transformers builds them (lara_mini), which the block's loader splits."""
    from transformers import conversion_mapping

    from agent.recipe.native.parts.linear_attention import stored_conversion

    rules = conversion_mapping.get_checkpoint_conversion_mapping(model_type) or []
    converters = [rule for rule in rules if type(rule).__name__ != "WeightRenaming"]
    return bool(converters) and all(stored_conversion(rule) for rule in converters)


SHARED_WIDTHS = {"config.moe_intermediate_size * config.n_shared_experts": "per_expert",
                 "config.shared_expert_intermediate_size": "shared_expert_intermediate_size",
                 "config.intermediate_size": "intermediate_size",
                 "config.shared_intermediate_size": "shared_intermediate_size"}


def shared_width_options(expr: str) -> dict:
    """The code's SHARED_WIDTH (and, for a width times a count other than moe_intermediate_size x n_shared_experts,
    SHARED_UNIT_KEY / SHARED_COUNT_KEY) for the shared experts' width expression `expr`."""
    if expr in SHARED_WIDTHS or "*" not in expr:          # "0": no shared experts
        return {"SHARED_WIDTH": SHARED_WIDTHS.get(expr, "per_expert")}
    unit, count = (term.strip()[len("config."):] for term in expr.split("*"))
    return {"SHARED_WIDTH": "per_expert", "SHARED_UNIT_KEY": unit, "SHARED_COUNT_KEY": count}


def _renormalisation(config, block_cls, scoring_match: dict):
    """The top-k renormalisation: Expr(config.norm_topk_prob) where toggling the key changes the block's gating,
    else the literal the probe found."""
    value = getattr(config, "norm_topk_prob", None)
    if not isinstance(value, bool) or _top_k(config) < 2:
        return scoring_match["renormalize"]
    toggled = copy.deepcopy(config)
    toggled.norm_topk_prob = not value
    probe, block, path = _probe_block(toggled, block_cls)
    other = _probe_gating(block, block.get_submodule(path), probe, PROBE_HIDDEN)
    if other["renormalize"] != scoring_match["renormalize"] and scoring_match["renormalize"] == value:
        return Expr("config.norm_topk_prob")
    return scoring_match["renormalize"]


def derive_moe(config, checkpoint_keys=()) -> dict | None:
    """The MoE facts of `config` (a transformers config: the checkpoint's, not shrunk); None when no layer has a
    sparse-MoE block with fused 3-D expert weights (every layer dense, e.g. first_k_dense_replace past the last
    layer: its MLPs are the generator's dense ones, which refuse any other block). `checkpoint_keys`: the keys of
    its config.json, which name the config attributes the code reads."""
    import torch

    experts_key = _config_key(config, EXPERT_COUNT_KEYS, "routed expert count", checkpoint_keys)
    topk_key = _config_key(config, TOPK_KEYS, "experts per token", checkpoint_keys)
    blocks = _sparse_blocks(config)
    if blocks is None:
        return None
    block_name, block_cls, sparse = blocks
    layout = sparse_layout(config, sparse)
    probe, block, path = _probe_block(config, block_cls)
    router_name = path.split(".")[0]
    width = block.experts.down_proj.shape[-1] if block.experts.down_proj.shape[-2] == PROBE_HIDDEN \
        else block.experts.down_proj.shape[-2]
    width_key = next((k for k in MOE_WIDTH_KEYS if getattr(probe, k, None) == width), None)
    if width_key is None:
        raise NotNative("moe", f"the experts' width {width} is none of the config's {' / '.join(MOE_WIDTH_KEYS)}")
    router = block.get_submodule(path)
    router_bias = isinstance(getattr(router, "bias", None), torch.Tensor)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        # the router's class (or the module holding it: hunyuan_v1_moe's gate makes its wg fp32) in bfloat16
        owner = block.get_submodule(router_name)
        built = type(owner)(probe)
        router_fp32 = (built.get_submodule(path.split(".", 1)[1]) if "." in path else built).weight.dtype == torch.float32
        if not router_fp32:
            router_fp32 = _logits_in_fp32(built)
    except TypeError:
        router_fp32 = False
    finally:
        torch.set_default_dtype(previous)
    gating = _probe_gating(block, router, probe, PROBE_HIDDEN)
    renormalize = _renormalisation(config, block_cls, gating)
    bias_found = selection_bias(block, router_name)
    bias_name = bias_found[1] if bias_found is not None and bias_found[1] != f"{router_name}.e_score_correction_bias" \
        else ""
    kind, activation, fused_layout = _probe_experts(block.experts, probe, PROBE_HIDDEN, gating["input_scaled"])
    alpha = float(getattr(block.experts, "alpha", 0.0) or 0.0) if activation == "clamped_swiglu" else 0.0
    shared, shared_name, shared_width = _probe_shared(block, probe, PROBE_HIDDEN)
    if shared is not None and activation == "clamped_swiglu_halves":
        _check_clamped_shared(block, shared_name, probe, PROBE_HIDDEN)
    if not gating["routed_scaling"] and _scaled_after_experts(block, probe, shared_name):
        gating = {**gating, "routed_scaling": True}     # the same product, as the weights' scale
    in_block = shared is not None
    if shared is None:
        shared, shared_name, shared_width = _probe_layer_shared(config, probe, PROBE_HIDDEN) or \
            (shared, shared_name, shared_width)
    zero_width = shared_width_without_count(config, block_cls, shared_name, shared_width) if shared is not None \
        else None
    biased = shared_bias(config, block_cls, block, shared_name) if in_block else False
    from agent.recipe.native.parts.moe_output_norm import output_norm

    norm_name = output_norm(block, PROBE_HIDDEN, probe, {router_name, "experts", shared_name, f"{shared_name}_gate"})
    ckpt_names = checkpoint_expert_names(config.model_type)
    if kind == "gmm" and not ckpt_names and not fused_experts_renamed(config.model_type) \
            and not fused_experts_as_built(config.model_type) and not fused_experts_stored(config.model_type):
        raise NotNative("moe", "experts stored fused in the checkpoint without biases: no per-expert names to stack")
    experts = getattr(config, experts_key)
    fused = ["npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_moe_finalize_routing"]
    unfused = []
    if gating["scoring"] == "softmax" and not gating["groups"] and not gating["selection_bias"]:
        fused.insert(0, "npu_moe_gating_top_k_softmax")
    elif (gating["scoring"] == "sigmoid" and gating["renormalize"] and gating["selection_bias"] and gating["groups"]
          and experts in (256, 384) and (getattr(config, "n_group", None), getattr(config, "topk_group", None)) == (8, 4)
          and _top_k(config) <= 32):
        fused.insert(0, "npu_moe_gating_top_k")
    elif gating["scoring"] == "sparsemixer":
        unfused.append("sparsemixer gating in plain torch (two rounds of a softmax over the experts near the best: "
                       "neither npu_moe_gating_top_k_softmax nor npu_moe_gating_top_k masks by a relative threshold)")
    elif gating.get("select_on_logits") and gating["selection_bias"]:
        unfused.append("gating in plain torch (the selection bias added to the logits, not the scores: no "
                       "npu_moe_gating_top_k mode picks by them)")
    elif gating.get("select_on_logits"):
        unfused.append("gating in plain torch (the top-k of the router's logits, then their sigmoid, as transformers' "
                       "router: npu_moe_gating_top_k takes renormalised sigmoid weights with a selection bias)")
    else:
        unfused.append("gating in plain torch (npu_moe_gating_top_k takes renormalised sigmoid weights with a "
                       "selection bias, 256 (or 384, upstream's deepseek_r1) experts in 8 groups keeping 4, k <= 32)")
    if gating["input_scaled"]:
        unfused.append("each routed row times its router weight in plain torch between npu_moe_init_routing_v2 and "
                       "the grouped matmul (llama4 scales the experts' inputs; the routing op's scale is a "
                       "quantisation's, one per token), npu_moe_finalize_routing's scales 1")
    if activation == "swiglu":
        fused.append("npu_swiglu")
    elif activation == "geglu_tanh":
        fused.append("npu_geglu (gelu tanh of the gate half)")
    elif activation == "clamped_swiglu_halves":
        unfused.append("clamped swiglu over gate / up halves (limit / alpha, up + 1), routed and shared experts, in "
                       "plain torch between the grouped matmuls: npu_swiglu has no clamp")
    else:
        unfused.append("clamped swiglu (limit / alpha, up + 1) in plain torch: npu_swiglu has no clamp")
    if norm_name:
        fused.append(f"npu_rms_norm (the block's output norm {norm_name})")
    return {"model_type": config.model_type, "block_name": block_name, "experts_key": experts_key, "topk_key": topk_key,
            "width_key": width_key, "sparse_layers": tuple(i for i, s in enumerate(sparse) if s), "sparse_rule": layout,
            "dense_variant": dense_layer_changes(layout, config) if layout != "all" else None,
            "router_name": router_name, "router_path": path, "router_bias": router_bias, "router_fp32": router_fp32,
            "topk_per_layer": top_k_per_layer(config), "select_on_logits": gating.get("select_on_logits", False),
            "scoring": gating["scoring"], "renormalize": renormalize, "selection_bias": gating["selection_bias"],
            "groups": gating["groups"], "group_select": gating["group_select"],
            "routed_scaling": gating["routed_scaling"], "input_scaled": gating["input_scaled"], "scaling_key": _scaling(config)[0] or "routed_scaling_factor",
            "selection_bias_name": bias_name, "experts": kind, "activation": activation,
            "gate_up_layout": fused_layout, "shared": shared, "shared_name": shared_name, "shared_width": shared_width,
            "shared_zero_width": zero_width, "shared_bias": biased, "ckpt_expert_names": ckpt_names, "swiglu_alpha": alpha, "fused": tuple(fused), "unfused": tuple(unfused),
            **({"output_norm": norm_name, "output_norm_class": type(getattr(block, norm_name)).__name__}
               if norm_name else {})}


def moe_options(f: dict) -> dict:
    """The code's options (code/moe.py, the block and the skeleton) for the facts `f` of derive_moe."""
    options = {"MOE": True, "MOE_LAYERS": f["sparse_rule"], "EXPERTS_KEY": f["experts_key"], "WIDTH_KEY": f["width_key"],
               "ROUTER": f["router_name"], "ROUTER_BIAS": f["router_bias"], "ROUTER_FP32": f["router_fp32"],
               "SCORING": f["scoring"], "RENORMALIZE": f["renormalize"], "SELECTION_BIAS": f["selection_bias"],
               "GROUPS": f["groups"], "GROUP_SELECT": f["group_select"], "ROUTED_SCALING": f["routed_scaling"],
               "EXPERTS": f["experts"], "FUSED_LAYOUT": f["gate_up_layout"], "SHARED": f["shared"],
               "SHARED_NAME": f["shared_name"], **shared_width_options(f["shared_width"])}
    if f["ckpt_expert_names"]:
        options["CKPT_EXPERT_NAMES"] = tuple(f["ckpt_expert_names"])
    if f.get("topk_key", "num_experts_per_tok") != "num_experts_per_tok":
        options["TOPK_KEY"] = f["topk_key"]
    if f.get("topk_per_layer"):
        options["TOPK_PER_LAYER"] = True
    if f.get("select_on_logits"):
        options["SELECT_ON_LOGITS"] = True
    if f.get("router_path", f["router_name"]) != f["router_name"]:
        options["ROUTER_STORED"] = f["router_path"]
    if f.get("selection_bias_name"):
        options["SELECTION_BIAS_NAME"] = f["selection_bias_name"]
    if f.get("routed_scaling") and f.get("scaling_key", "routed_scaling_factor") != "routed_scaling_factor":
        options["SCALING_KEY"] = f["scaling_key"]
    if f["activation"] == "clamped_swiglu":
        options["SWIGLU_ALPHA"] = f["swiglu_alpha"]
    if f["activation"] == "clamped_swiglu_halves":
        options["CLAMPED_SWIGLU"] = True
    if f["activation"] == "geglu_tanh":
        options["GEGLU"] = True
    if f.get("input_scaled"):
        options["INPUT_SCALED"] = True
    if f.get("output_norm"):
        options["OUTPUT_NORM"] = f["output_norm"]
    if f.get("shared_zero_width"):
        options["SHARED_ZERO_WIDTH"] = f["shared_zero_width"]
    if f.get("shared_bias") is not None and f.get("shared_bias") is not False:
        options["SHARED_BIAS"] = f["shared_bias"]
    return options


def _probe(probe, chosen):
    data = probe.config_dict
    if not any(isinstance(data.get(k), int) and data[k] > 1 for k in EXPERT_COUNT_KEYS):
        return None
    facts = derive_moe(probe.full_config, checkpoint_keys=set(data))
    if facts is None:
        return None
    if facts.get("output_norm"):
        from agent.recipe.native.parts.moe_output_norm import same_norm_as_layers

        same_norm_as_layers(probe, facts)
        return Match(SPARSE_MOE_OUTPUT_NORM, options=moe_options(facts), facts=facts)
    return Match(SPARSE_MOE, options=moe_options(facts), facts=facts)


def _variants(match, probe):
    """The file serves the family's MoE layout switches: the sparse layers by the other settings of the key that
    decides them, the renormalisation where norm_topk_prob sets it, no shared experts, grouped routing."""
    f, found = match.facts, []
    rule = f["sparse_rule"]
    if rule == "decoder_sparse_step":
        found += [("decoder_sparse_step 2", {"decoder_sparse_step": 2, "mlp_only_layers": []}),
                  ("mlp_only_layers [0]", {"decoder_sparse_step": 1, "mlp_only_layers": [0]})]
    elif rule in ("first_k_dense_replace", "num_dense_layers"):
        found.append((f"{rule} 0 / 1", {rule: 0 if getattr(probe.config, rule) else 1}))
    elif rule == "moe_layer_interval":
        found.append(("moe_layer_interval 2 from layer 0", {"moe_layer_interval": 2, "moe_layer_start_index": 0}))
    elif rule == "expert_layer_period":
        found.append(("expert_layer_offset 0", {"expert_layer_offset": 0 if probe.config.expert_layer_offset else 1}))
    elif rule == "mlp_layer_types":
        types = list(probe.config.mlp_layer_types)
        found.append(("mlp_layer_types flipped", {"mlp_layer_types": ["dense" if t == "sparse" else "sparse" for t in types]}))
    if f.get("topk_per_layer"):
        # layers of unequal experts per token: each layer's block reads its own entry
        found.append(("experts per token per layer", {f["topk_key"]: [2 - i % 2 for i in range(probe.config.num_hidden_layers)]}))
    if f["scoring"] == "sparsemixer":
        found.append(("router_jitter_noise 0.5", {"router_jitter_noise": 0.5}))   # several experts in each softmax
    if isinstance(f["renormalize"], Expr):
        found.append(("norm_topk_prob", {"norm_topk_prob": not probe.config.norm_topk_prob}))
    if f["shared"] is not None:
        widths = shared_width_options(f["shared_width"])
        key = widths.get("SHARED_COUNT_KEY", "n_shared_experts") if widths["SHARED_WIDTH"] == "per_expert" \
            else widths["SHARED_WIDTH"]
        if key == f["width_key"]:
            pass          # the experts' own width (hunyuan_v1_moe's shared_mlp): always there
        elif getattr(probe.config, key, None) and f.get("shared_zero_width"):
            # transformers builds them all the same, of another width (hy_v3's intermediate_size)
            found.append((f"{key} 0 (shared experts of {f['shared_zero_width']})", {key: 0}))
        elif getattr(probe.config, key, None):
            found.append(("no shared experts", {key: 0}))
        else:   # the checkpoint's config has none (granitemoeshared's default): the family's with them
            found.append(("shared experts", {key: 1 if key != widths["SHARED_WIDTH"] else getattr(probe.config, f["width_key"])}))
    if isinstance(f.get("shared_bias"), Expr):
        # the shared experts' biases by the key (the dense MLP's part names the same setting where it reads it too)
        key = f["shared_bias"].code.split(".", 1)[1]
        found.append((f"bias {key}", {key: not getattr(probe.config, key)}))
    if f["groups"]:
        experts = getattr(probe.config, f["experts_key"])
        found.append(("grouped routing", {"n_group": 2, "topk_group": 1} if experts % 2 == 0 and probe.config.n_group == 1
                      else {"n_group": 1, "topk_group": 1}))
    return found


SPARSE_MOE = Part(
    slot="moe", name="sparse_moe", code="moe.py", provides="ModelSparseMoeBlock",
    reads=("num_experts_per_tok / moe_topk / moe_k", "n_routed_experts / num_experts / num_local_experts", "moe_intermediate_size",
           "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace",
           "decoder_sparse_step", "mlp_only_layers", "n_shared_experts", "shared_expert_intermediate_size",
           "moe_layer_start_index / moe_layer_interval / moe_layer_end_index", "router_scaling_factor",
           "expert_layer_period / expert_layer_offset",
           "moe_num_shared_experts / num_shared_experts"),
    probe=_probe, kernels=lambda m: (m.facts["fused"], m.facts["unfused"]), variants=_variants,
    options=("MOE", "MOE_LAYERS", "EXPERTS_KEY", "WIDTH_KEY", "ROUTER", "ROUTER_BIAS", "ROUTER_FP32", "SCORING",
             "RENORMALIZE", "SELECTION_BIAS", "GROUPS", "GROUP_SELECT", "ROUTED_SCALING", "EXPERTS", "SWIGLU_ALPHA",
             "FUSED_LAYOUT", "CKPT_EXPERT_NAMES", "SHARED", "SHARED_NAME", "SHARED_WIDTH", "SELECTION_BIAS_NAME",
             "SCALING_KEY", "SHARED_UNIT_KEY", "SHARED_COUNT_KEY", "TOPK_KEY", "TOPK_PER_LAYER", "ROUTER_STORED",
             "SELECT_ON_LOGITS", "CLAMPED_SWIGLU", "SHARED_ZERO_WIDTH", "SHARED_BIAS", "INPUT_SCALED", "GEGLU"))


# the block whose output is RMS-normed (axk1's post_mlp_layernorm: parts/moe_output_norm.py reads it): chosen by
# sparse_moe's probe, the same facts
SPARSE_MOE_OUTPUT_NORM = replace(
    SPARSE_MOE, name="sparse_moe_output_norm", code="moe_output_norm.py", provides="ModelOutputNormedSparseMoeBlock",
    reads=SPARSE_MOE.reads + ("rms_norm_eps",), probe=lambda probe, chosen: None, options=SPARSE_MOE.options + ("OUTPUT_NORM",))


def render_moe(facts: dict) -> str:
    """code/moe.py for `facts` (derive_moe's) as a module of its own: the sparse-MoE block, is_moe_layer and the
    registration of its communication groups, nothing else (the block's own tests and its multi-rank harness)."""
    from agent.recipe.native.assemble import assemble
    from agent.recipe.native.parts import OPTION_NAMES

    prefix = "".join(part[:1].upper() + part[1:] for part in facts["model_type"].split("_"))
    return assemble(["moe.py"], options=moe_options(facts), option_names=OPTION_NAMES, roles={}, prefix=prefix,
                    framework_class=f"{prefix}ForCausalLM", keep=("ModelSparseMoeBlock", "is_moe_layer", "register_expert_groups"),
                    header="# coding=utf-8")
