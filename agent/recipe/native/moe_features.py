"""What an architecture's sparse-MoE layers are, read from its transformers code and config:
`derive_moe(config) -> MoeFeatures`, rendered by `templates/framework/native/moe.py.j2`.

Nothing here is a per-model table. The transformers model is built on the meta device from the
config (every layer, no memory) to find which layers are sparse and where the MoE block sits; the
block's class is then built on a shrunk copy (fp32, random weights, the same expert / group counts)
and probed numerically:

* routing: the block's experts module is called with the routing the block computed (tokens' expert
  indices and weights, captured); candidate gatings (softmax or sigmoid scores, a selection bias,
  grouped top-k by max or top-2 sum, renormalised or not, routed scaling) are computed from the
  captured router logits' inputs and the one that gives the same experts and weights is the block's;
* experts: one expert's output for a known input against the candidate formulas (gate/up halves and
  the config's activation, as `npu_swiglu` computes it; gpt_oss's interleaved gate/up with clamp
  limit / alpha, `up + 1` and per-expert biases);
* checkpoint names: transformers' own conversion mapping (`transformers.conversion_mapping`), which
  merges the checkpoint's per-expert tensors into the fused 3-D parameters (w1/w3/w2 or
  gate_proj/up_proj/down_proj; mixtral's `block_sparse_moe` renamed to `mlp`); none: the checkpoint
  stores the fused tensors (gpt_oss).

Anything not recognised raises `NotNative("moe", reason)`: the recipe keeps the adapter.
"""

from __future__ import annotations

import copy
import re
from dataclasses import asdict, dataclass, field

from agent.recipe.native.not_native import NotNative   # one fall-back answer for every layer kind

EXPERT_COUNT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
MOE_WIDTH_KEYS = ("moe_intermediate_size", "intermediate_size")
ROUTER_NAMES = ("gate", "router")
SHARED_NAMES = ("shared_experts", "shared_expert")
# The shrunk probe: small widths, the real counts where routing depends on them (groups), capped.
PROBE_HIDDEN, PROBE_WIDTH, PROBE_EXPERT_CAP = 40, 24, 256   # no width (24, 28, 32) nor twice one equals hidden


@dataclass(frozen=True)
class MoeFeatures:
    model_type: str
    block_name: str                    # the decoder layer's attribute holding the MoE block ("mlp")
    ckpt_block_name: str               # its name in the checkpoint ("block_sparse_moe" for mixtral)
    experts_key: str                   # config attribute: the routed expert count
    width_key: str                     # config attribute: one expert's intermediate size
    sparse_layers: tuple[int, ...]     # the layers whose MLP is the MoE block (of the config probed)
    sparse_rule: str                   # "all" | "first_k_dense_replace" | "num_dense_layers" | "mlp_layer_types" | "decoder_sparse_step"
    router_name: str                   # "gate" | "router"
    router_bias: bool                  # the router linear has a bias (gpt_oss)
    router_fp32: bool                  # router weight and its input kept in fp32 (deepseek_v3)
    scoring: str                       # "softmax" | "sigmoid"
    renormalize: bool                  # top-k weights divided by their sum (norm_topk_prob)
    selection_bias: bool               # e_score_correction_bias added for selection only
    groups: bool                       # grouped top-k (n_group / topk_group)
    group_select: str                  # "max" | "top2_sum" (the group's score)
    routed_scaling: bool               # weights times config.routed_scaling_factor
    experts: str                       # "gmm" (halves, no bias: FusedMoEGMM) | "biased_interleaved" (gpt_oss)
    activation: str                    # "swiglu" (npu_swiglu) | "clamped_swiglu" (limit / alpha, up + 1)
    gate_up_layout: str                # transformers' fused parameter: "E,2I,H" or "E,H,2I"
    shared: str                        # "none" | "plain" | "gated" (a sigmoid gate on the shared output)
    shared_name: str                   # the block's attribute for shared experts
    shared_width: str                  # python expression over `config` for the shared experts' width
    ckpt_expert_names: tuple[str, ...]  # (gate, up, down) per-expert names; () when stored fused
    swiglu_alpha: float = 0.0          # clamped swiglu's alpha where the config has none (transformers' constant)
    fused: tuple[str, ...] = field(default=())
    unfused: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict:
        return asdict(self)

    def with_changes(self, **changes) -> "MoeFeatures":
        """A copy with some facts changed (the fault cases)."""
        data = {**self.as_dict(), **changes}
        for key in ("sparse_layers", "ckpt_expert_names", "fused", "unfused"):
            data[key] = tuple(data[key])
        return MoeFeatures(**data)


def _config_key(config, keys: tuple[str, ...], what: str, checkpoint_keys=()) -> str:
    """The first of `keys` the config sets: a name of the checkpoint's config.json first (what the
    generated code reads with upstream's transformers pin), then one this release stores (not an
    attribute_map alias, which another release may lack)."""
    stored = config.to_dict()
    for key in sorted(keys, key=lambda k: (k not in checkpoint_keys, k not in stored)):
        if isinstance(getattr(config, key, None), int) and getattr(config, key) > 0:
            return key
    raise NotNative("moe", f"no {what} in the config ({' / '.join(keys)})")


def moe_block(layer):
    """(attribute name, module) of the layer's sparse-MoE block: a child with an `experts` module
    holding fused 3-D expert parameters; None for a dense layer."""
    for name, child in layer.named_children():
        experts = getattr(child, "experts", None)
        if experts is not None and getattr(experts, "gate_up_proj", None) is not None \
                and getattr(experts.gate_up_proj, "dim", lambda: 0)() == 3:
            return name, child
    return None


def _sparse_rule(config, sparse: list[bool]) -> str:
    """The config rule that reproduces transformers' own layer choice; none: not native."""
    n = len(sparse)
    rules = {"all": [True] * n}
    for key in ("first_k_dense_replace", "num_dense_layers"):
        k = getattr(config, key, None)
        if isinstance(k, int):
            rules[key] = [i >= k for i in range(n)]
    types = getattr(config, "mlp_layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) >= n:
        rules["mlp_layer_types"] = [t == "sparse" for t in types[:n]]
    step, only = getattr(config, "decoder_sparse_step", None), getattr(config, "mlp_only_layers", None)
    if isinstance(step, int) and step > 0:
        rules["decoder_sparse_step"] = [i not in (only or []) and (i + 1) % step == 0 for i in range(n)]
    for name, pattern in rules.items():
        if pattern == sparse:
            return name
    raise NotNative("moe", f"sparse layers {[i for i, s in enumerate(sparse) if s]} follow none of "
                           f"{sorted(rules)} as the config states them")


def _probe_config(config):
    """A shrunk copy: tiny widths, the routed expert count and groups kept (capped), fp32."""
    import torch

    probe = copy.deepcopy(config)
    probe.hidden_size = PROBE_HIDDEN
    # distinct widths: which config key sizes the experts (and the shared experts) is read off their shapes
    for offset, key in enumerate(MOE_WIDTH_KEYS + ("shared_expert_intermediate_size",)):
        if isinstance(getattr(probe, key, None), int):
            setattr(probe, key, PROBE_WIDTH + 4 * offset)
    experts_key = _config_key(probe, EXPERT_COUNT_KEYS, "routed expert count")
    count = getattr(probe, experts_key)
    if count > PROBE_EXPERT_CAP:
        groups = getattr(probe, "n_group", None) or 1
        setattr(probe, experts_key, PROBE_EXPERT_CAP - PROBE_EXPERT_CAP % groups)
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

    handle = experts.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            out = block(x)
    finally:
        handle.remove()
    if "index" not in seen or seen["index"] is None:
        raise NotNative("moe", f"{type(block).__name__} does not call its experts with (hidden, indices, weights)")
    return seen["index"], seen["weights"], out[0] if isinstance(out, tuple) else out


def _router_logits(router, x):
    import torch

    weight = router.weight
    bias = getattr(router, "bias", None)
    with torch.no_grad():
        return torch.nn.functional.linear(x.to(weight.dtype), weight, bias if isinstance(bias, torch.Tensor) else None)


def selection(logits, *, scoring, selection_bias=None, n_group=1, topk_group=1, group_select="top2_sum"):
    """(scores, choice) in fp32: the gate's scores of every expert, and what the top-k picks by (the
    scores plus the selection bias, experts outside the kept groups at -inf)."""
    import torch

    logits = logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = scores + selection_bias.float() if selection_bias is not None else scores
    if n_group > 1:
        grouped = choice.view(choice.shape[0], n_group, -1)
        group_scores = grouped.amax(-1) if group_select == "max" else grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(choice.shape[0], -1)
    return scores, choice


def reference_gating(logits, *, k, scoring, renormalize, selection_bias=None, n_group=1, topk_group=1,
                     group_select="top2_sum", routed_scaling_factor=1.0, index=None):
    """The gatings the generated code expresses, in plain torch (fp32): (weights [T, k], indices [T, k]);
    `index`: these experts rather than the top-k (their weights by the same formula)."""
    scores, choice = selection(logits, scoring=scoring, selection_bias=selection_bias, n_group=n_group,
                               topk_group=topk_group, group_select=group_select)
    if index is None:
        index = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, index.long())
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    return weights * routed_scaling_factor, index


def _same_routing(index_a, weights_a, index_b, weights_b) -> bool:
    import torch

    order_a, order_b = index_a.sort(-1), index_b.sort(-1)
    if not torch.equal(order_a.values.long(), order_b.values.long()):
        return False
    wa = weights_a.float().gather(1, order_a.indices)
    wb = weights_b.float().gather(1, order_b.indices)
    return torch.allclose(wa, wb, rtol=1e-5, atol=1e-6)


def _probe_gating(block, router, config, hidden: int) -> dict:
    """The candidate gating that routes as the block does (one, or NotNative)."""
    import torch

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(24, hidden, generator=gen)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        bias = getattr(router, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):     # large enough to change which experts are chosen
            bias.copy_(torch.rand(bias.shape, generator=gen) * 0.5)
    index, weights, _ = _capture_routing(block, x[None])
    index, weights = index.reshape(x.shape[0], -1), weights.reshape(x.shape[0], -1)
    logits = _router_logits(router, x)
    k = index.shape[-1]
    has_bias = isinstance(getattr(router, "e_score_correction_bias", None), torch.Tensor)
    n_group = int(getattr(config, "n_group", None) or 1)
    topk_group = int(getattr(config, "topk_group", None) or 1)
    factor = getattr(config, "routed_scaling_factor", None)
    matches = []
    for scoring in ("softmax", "sigmoid"):
        for renormalize in (True, False):
            for group_select in (("top2_sum", "max") if n_group > 1 else ("top2_sum",)):
                for scaled in ((True, False) if isinstance(factor, (int, float)) and factor != 1 else (False,)):
                    w, i = reference_gating(logits, k=k, scoring=scoring, renormalize=renormalize,
                                            selection_bias=router.e_score_correction_bias if has_bias else None,
                                            n_group=n_group, topk_group=topk_group, group_select=group_select,
                                            routed_scaling_factor=float(factor) if scaled else 1.0)
                    if _same_routing(index, weights, i, w):
                        matches.append(dict(scoring=scoring, renormalize=renormalize, groups=n_group > 1,
                                            group_select=group_select, routed_scaling=scaled, selection_bias=has_bias))
    if not matches:
        raise NotNative("moe", f"{type(block).__name__} routes by no gating the NPU ops or the plain-torch gate "
                               "express (softmax / sigmoid, selection bias, grouped top-k, renormalised, scaled)")
    return matches[0]


def _probe_experts(experts, config, hidden: int) -> tuple[str, str, str]:
    """(experts kind, activation, gate_up layout) from one expert's output against the candidates."""
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
    for (kind, activation), want in candidates.items():
        if torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            if kind == "gmm" and getattr(act, "__name__", type(act).__name__).lower() not in ("silu", "siluactivation") \
                    and not isinstance(act, torch.nn.SiLU):
                raise NotNative("moe", f"expert activation {type(act).__name__}: npu_swiglu computes silu only")
            return kind, activation, layout
    raise NotNative("moe", f"{type(experts).__name__} computes none of: gate/up halves with silu (npu_swiglu), "
                           "gpt_oss's interleaved clamped swiglu with biases")


def _probe_shared(block, config, hidden: int) -> tuple[str, str, str]:
    """(kind, attribute, width expression) of the block's shared experts."""
    for name in SHARED_NAMES:
        shared = getattr(block, name, None)
        if shared is None:
            continue
        gated = getattr(block, f"{name}_gate", None) is not None
        width = shared.down_proj.weight.shape[-1]
        for expr in ("config.moe_intermediate_size * config.n_shared_experts", "config.shared_expert_intermediate_size",
                     "config.intermediate_size"):
            try:
                if eval(expr, {"config": config}) == width:    # noqa: S307 - our own fixed expressions
                    return ("gated" if gated else "plain"), name, expr
            except (AttributeError, TypeError):
                continue
        raise NotNative("moe", f"shared experts of width {width}: no config expression gives it")
    return "none", "shared_experts", "0"


def _plain_path(pattern: str) -> tuple[str, ...] | None:
    """A conversion rule's pattern as module names ("\\.mlp\\.gate" -> ("mlp", "gate")); None for a regex
    that is more than a dotted name."""
    text = pattern.replace("\\.", ".").strip("^$").strip(".")
    parts = tuple(text.split("."))
    return parts if all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", p) for p in parts) else None


def _checkpoint_names(model_type: str, block_name: str) -> tuple[str, tuple[str, ...]]:
    """(the block's name in the checkpoint, (gate, up, down) per-expert names) from transformers'
    conversion mapping; () where the checkpoint stores the fused tensors. A rule that renames, splits or
    merges anything else: the native loader, which reads the checkpoint's names as the modules', would
    miss those tensors — not native."""
    from transformers import conversion_mapping

    rules = conversion_mapping.get_checkpoint_conversion_mapping(model_type) or []
    ckpt_block, names = block_name, ()
    for rule in rules:
        sources = list(rule.source_patterns)
        targets = list(rule.target_patterns)
        if type(rule).__name__ == "WeightRenaming":
            for s, t in zip(sources, targets):
                src, dst = _plain_path(s), _plain_path(t)
                if src and dst and dst[0] == block_name and src[1:] == dst[1:] and src[0] != dst[0]:
                    ckpt_block = src[0]        # the block's own name in the checkpoint (mixtral's block_sparse_moe)
                else:
                    raise NotNative("moe", f"transformers renames checkpoint tensors {s!r} -> {t!r} for {model_type}: "
                                           "the native loader reads the modules' own names")
        elif all("experts.*." in src for src in sources):
            if any(t.endswith("experts.gate_up_proj") for t in targets) and len(sources) == 2:
                gate, up = (src.split("experts.*.", 1)[1].rsplit(".weight", 1)[0] for src in sources)
                names = (gate, up) + names[2:] if len(names) == 3 else (gate, up)
            elif any(t.endswith("experts.down_proj") for t in targets) and len(sources) == 1:
                down = sources[0].split("experts.*.", 1)[1].rsplit(".weight", 1)[0]
                names = (*names[:2], down) if len(names) >= 2 else names + (down,)
            else:
                raise NotNative("moe", f"transformers merges {sources} into {targets} for {model_type}: not the "
                                       "experts' gate/up and down")
            head = _plain_path(sources[0].split("experts.*.", 1)[0])
            if head and head[0] != block_name:
                ckpt_block = head[0]
        elif [_plain_path(src) for src in sources] != [_plain_path(t) for t in targets]:
            raise NotNative("moe", f"transformers converts checkpoint tensors {sources} -> {targets} for {model_type}: "
                                   "the native loader reads the modules' own names")
    if names and len(names) != 3:
        raise NotNative("moe", f"transformers' conversion mapping for {model_type} names {names} for the experts")
    return ckpt_block, tuple(names)


def _sparse_blocks(config):
    """(block attribute, block class, sparse flags per layer, sparse rule) of `config`'s model, built on the
    meta device (every layer, no memory); None when no layer has such a block."""
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
    return names.pop(), classes.pop(), sparse, _sparse_rule(config, sparse)


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
    router_name = next((n for n in ROUTER_NAMES if getattr(block, n, None) is not None
                        and getattr(getattr(block, n), "weight", None) is not None), None)
    if router_name is None:
        raise NotNative("moe", f"{block_cls.__name__} has no gate / router with a weight")
    return probe, block, router_name


def gating_of(config) -> dict:
    """How `config`'s sparse-MoE blocks route, probed as derive_moe probes it: {"block_name", "router_name",
    "k", "scoring", "renormalize", "selection_bias", "groups", "group_select", "routed_scaling",
    "n_group", "topk_group", "routed_scaling_factor"} (NotNative: a routing none of the candidates is)."""
    blocks = _sparse_blocks(config)
    if blocks is None:
        raise NotNative("moe", "no layer has a sparse-MoE block with fused 3-D expert weights")
    block_name, block_cls, _, _ = blocks
    probe, block, router_name = _probe_block(config, block_cls)
    gating = _probe_gating(block, getattr(block, router_name), probe, PROBE_HIDDEN)
    factor = getattr(config, "routed_scaling_factor", None)
    return {**gating, "block_name": block_name, "router_name": router_name, "k": int(config.num_experts_per_tok),
            "n_group": int(getattr(config, "n_group", None) or 1), "topk_group": int(getattr(config, "topk_group", None) or 1),
            "routed_scaling_factor": float(factor) if gating["routed_scaling"] else 1.0}


def derive_moe(config, checkpoint_keys=()) -> MoeFeatures | None:
    """The MoE features of `config` (a transformers config: the checkpoint's, not shrunk); None when no layer
    has a sparse-MoE block with fused 3-D expert weights (every layer dense, e.g. first_k_dense_replace past the
    last layer: its MLPs are the generator's dense ones, which refuse any other block). `checkpoint_keys`: the
    keys of its config.json, which name the config attributes the code reads."""
    import torch

    experts_key = _config_key(config, EXPERT_COUNT_KEYS, "routed expert count", checkpoint_keys)
    blocks = _sparse_blocks(config)
    if blocks is None:
        return None
    block_name, block_cls, sparse, rule = blocks
    probe, block, router_name = _probe_block(config, block_cls)
    width = block.experts.down_proj.shape[-1] if block.experts.down_proj.shape[-2] == PROBE_HIDDEN \
        else block.experts.down_proj.shape[-2]
    width_key = next((k for k in MOE_WIDTH_KEYS if getattr(probe, k, None) == width), None)
    if width_key is None:
        raise NotNative("moe", f"the experts' width {width} is none of the config's {' / '.join(MOE_WIDTH_KEYS)}")
    router = getattr(block, router_name)
    router_bias = isinstance(getattr(router, "bias", None), torch.Tensor)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        router_fp32 = type(router)(probe).weight.dtype == torch.float32
    except TypeError:
        router_fp32 = False
    finally:
        torch.set_default_dtype(previous)
    gating = _probe_gating(block, router, probe, PROBE_HIDDEN)
    kind, activation, layout = _probe_experts(block.experts, probe, PROBE_HIDDEN)
    alpha = float(getattr(block.experts, "alpha", 0.0) or 0.0) if activation == "clamped_swiglu" else 0.0
    shared, shared_name, shared_width = _probe_shared(block, probe, PROBE_HIDDEN)
    ckpt_block, ckpt_names = _checkpoint_names(config.model_type, block_name)
    if kind == "gmm" and not ckpt_names:
        raise NotNative("moe", "experts stored fused in the checkpoint without biases: no per-expert names to stack")
    experts = getattr(config, experts_key)
    fused = ["npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_moe_finalize_routing"]
    unfused = []
    if gating["scoring"] == "softmax" and not gating["groups"] and not gating["selection_bias"]:
        fused.insert(0, "npu_moe_gating_top_k_softmax")
    elif (gating["scoring"] == "sigmoid" and gating["renormalize"] and gating["selection_bias"] and gating["groups"]
          and experts in (256, 384) and (getattr(config, "n_group", None), getattr(config, "topk_group", None)) == (8, 4)
          and config.num_experts_per_tok <= 32):
        fused.insert(0, "npu_moe_gating_top_k")
    else:
        unfused.append("gating in plain torch (npu_moe_gating_top_k takes renormalised sigmoid weights with a "
                       "selection bias, 256 (or 384, upstream's deepseek_r1) experts in 8 groups keeping 4, k <= 32)")
    if activation == "swiglu":
        fused.append("npu_swiglu")
    else:
        unfused.append("clamped swiglu (limit / alpha, up + 1) in plain torch: npu_swiglu has no clamp")
    return MoeFeatures(
        model_type=config.model_type, block_name=block_name, ckpt_block_name=ckpt_block, experts_key=experts_key,
        width_key=width_key, sparse_layers=tuple(i for i, s in enumerate(sparse) if s), sparse_rule=rule,
        router_name=router_name, router_bias=router_bias, router_fp32=router_fp32, scoring=gating["scoring"],
        renormalize=gating["renormalize"], selection_bias=gating["selection_bias"], groups=gating["groups"],
        group_select=gating["group_select"], routed_scaling=gating["routed_scaling"], experts=kind,
        activation=activation, gate_up_layout=layout, shared=shared, shared_name=shared_name,
        shared_width=shared_width, ckpt_expert_names=ckpt_names, swiglu_alpha=alpha, fused=tuple(fused), unfused=tuple(unfused))


def class_prefix(model_type: str) -> str:
    """The class-name prefix of the generated code: `qwen3_moe` -> `Qwen3Moe`."""
    return "".join(part[:1].upper() + part[1:] for part in model_type.split("_"))


def render_moe(features: MoeFeatures, standalone: bool = True) -> str:
    """templates/framework/native/moe.py.j2 for `features`: a module of its own (`standalone`), or the
    fragment a native modeling file includes after its imports."""
    from agent.recipe.templating import environment

    template = environment().get_template("framework/native/moe.py.j2")
    return template.render(features=features, prefix=class_prefix(features.model_type), standalone=standalone,
                           swiglu_alpha=features.swiglu_alpha).lstrip("\n") + "\n"
