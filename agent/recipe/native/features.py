"""What an architecture is, read from its transformers code and config: `derive(config) -> NativeFeatures`.

Nothing here is a per-model table. The transformers model class is built on a shrunk copy of the
configuration (tiny widths, the first layers that hold every layer kind, random weights, fp32) and
read: its decoder layer's module tree (separate or fused q/k/v and gate/up projections, q/k norms,
sandwich norms), its formulas probed numerically (RMSNorm `x*w` or `x*(1+w)`, the embedding's scale,
rotate-half rotary, the gated activation, the attention's scale), and config facts (head_dim,
partial rotary, rope type and bases per layer type, sliding windows as transformers' own cache
decides them, soft-capping, biases, tied embeddings). Anything not recognised raises `NotNative`
with the layer kind and the reason: the recipe keeps the adapter.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from agent.recipe.native.not_native import NotNative  # noqa: F401 - the generator's answer, importable from here

# the rope initialisations whose inverse frequencies do not depend on the sequence length
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ACT_KEYS = ("hidden_act", "hidden_activation")
ATTENTION_CHILDREN = {"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "q_norm", "k_norm", "rotary_fn"}
MLP_CHILDREN = {"gate_proj", "up_proj", "gate_up_proj", "down_proj", "act_fn", "activation_fn"}
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
MODEL_CHILDREN = {"embed_tokens", "layers", "norm", "rotary_emb"}


@dataclass(frozen=True)
class NativeFeatures:
    model_type: str
    fused_qkv: bool                  # the checkpoint stores one qkv_proj (phi3) rather than q/k/v_proj
    qkv_bias: bool
    qk_norm: bool                    # per-head RMSNorm of queries and keys before the rotary (qwen3, gemma3)
    fused_gate_up: bool              # the checkpoint stores one gate_up_proj (phi3)
    activation: str                  # ACT2FN key of the gate's activation
    act_key: str                     # the config attribute naming it
    norm_offset: float               # RMSNorm scales by (offset + w): 0 (llama) or 1 (gemma)
    sandwich: bool                   # post-attention and pre/post-feedforward norms (gemma2, gemma3)
    embed_scale: str                 # "unscaled" or "sqrt_hidden" (the embedding times sqrt(hidden_size))
    scaling: str                     # "head_dim" or "query_pre_attn_scalar": softmax scale = that ** -0.5
    rope_by_layer_type: bool         # rope_parameters per layer type (gemma3's local and global bases)
    rope_types: tuple[str, ...]      # the rope initialisations used
    partial_rotary: bool             # rotary on the first head_dim * partial_rotary_factor dims only
    sliding: bool                    # some layers attend in a sliding window
    windows_from_layer_types: bool   # which layers: config.layer_types (else every layer)
    attn_softcap: bool               # attention logits soft-capped (gemma2): plain-torch attention
    final_softcap: bool              # logits soft-capped
    tie_word_embeddings: bool
    eps_key: str = "rms_norm_eps"
    attn_sinks: bool = False                         # a learnable sink logit per head in the softmax (gpt_oss)
    o_bias: bool = False                             # o_proj has a bias (added once: module.linear's row-parallel rank 0)
    moe: "MoeFeatures | None" = None                 # the sparse-MoE layers (agent.recipe.native.moe_features)
    fused: tuple[str, ...] = field(default=())       # what runs as a torch_npu fused kernel
    unfused: tuple[str, ...] = field(default=())     # what stays plain torch, and why
    mla: "MlaFeatures | None" = None                 # latent attention (agent.recipe.native.mla_features)

    def as_dict(self) -> dict:
        return asdict(self)

    def with_changes(self, **changes) -> "NativeFeatures":
        """A copy with some facts changed (the self-check's fault cases)."""
        data = {**self.as_dict(), "moe": self.moe, **changes}
        data["fused"], data["unfused"] = tuple(data["fused"]), tuple(data["unfused"])
        data["rope_types"] = tuple(data["rope_types"])
        if "mla" not in changes:
            data["mla"] = self.mla          # asdict turned it into a dict
        return NativeFeatures(**data)


def shrunk_config(config_dict: dict):
    """The transformers config of `config_dict` with tiny widths and the first layers that hold every
    layer kind (agent.recipe.shrink), in fp32, eager attention, a small sliding window (when the
    architecture has one) so that a short sequence crosses it, and a query_pre_attn_scalar unequal
    to head_dim so that the two scales differ."""
    from transformers import AutoConfig

    from agent.recipe.shrink import shrink_config

    data = {k: v for k, v in config_dict.items() if k not in ("auto_map", "quantization_config", "architectures")}
    overrides = shrink_config(data)
    data.update(overrides)
    if isinstance(data.get("sliding_window"), int):
        data["sliding_window"] = 5
    if isinstance(data.get("query_pre_attn_scalar"), (int, float)):
        data["query_pre_attn_scalar"] = 24
    model_type = data.pop("model_type")
    data.pop("transformers_version", None)
    data["torch_dtype"] = "float32"
    data["dtype"] = "float32"
    config = AutoConfig.for_model(model_type, **data)
    config._attn_implementation = "eager"
    return config


def _act_key(config) -> str:
    for key in ACT_KEYS:
        if isinstance(getattr(config, key, None), str):
            return key
    raise NotNative("mlp", "no hidden_act / hidden_activation in the config")


def _children(module) -> dict:
    """A module's children, dropouts left out (identities at inference)."""
    import torch

    return {name: child for name, child in module.named_children() if not isinstance(child, torch.nn.Dropout)}


def _probe_norm(norm, width: int) -> float:
    """0 for y = w * x / rms(x), 1 for y = (1 + w) * x / rms(x); anything else is not an RMSNorm."""
    import torch

    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(1))
    weight = getattr(norm, "weight", None)
    if weight is None or tuple(weight.shape) != (width,):
        raise NotNative("norm", f"{type(norm).__name__} has no weight of width {width}")
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    w = torch.randn(width, generator=torch.Generator().manual_seed(2))
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.copy_(w)
            y = norm(x)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    for offset in (0.0, 1.0):
        if torch.allclose(y, rms * (offset + w), rtol=1e-4, atol=1e-5):
            return offset
    raise NotNative("norm", f"{type(norm).__name__} is neither x*w nor x*(1+w) over the RMS")


def _probe_mlp(mlp, hidden: int, activation) -> None:
    """The MLP is down(act(gate(x)) * up(x)) (separate or fused gate/up), nothing else."""
    import torch

    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(3))
    children = _children(mlp)
    with torch.no_grad():
        if "gate_up_proj" in children:
            gate, up = children["gate_up_proj"](x).chunk(2, dim=-1)
        else:
            gate, up = children["gate_proj"](x), children["up_proj"](x)
        expected = children["down_proj"](activation(gate) * up)
        got = mlp(x)
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        raise NotNative("mlp", f"{type(mlp).__name__} is not down(act(gate(x)) * up(x))")


def _probe_rotary(modeling_module) -> None:
    """The architecture's apply_rotary_pos_emb is q*cos + rotate_half(q)*sin (npu_apply_rotary_pos_emb's
    formula); an interleaved or other rotary is not native."""
    import torch

    apply = getattr(modeling_module, "apply_rotary_pos_emb", None)
    if apply is None:
        raise NotNative("attention", "no apply_rotary_pos_emb in the modeling code")
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 2, 3, 8, generator=gen)
    angles = torch.randn(1, 3, 4, generator=gen)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def half(x):
        return x * cos[:, None] + torch.cat((-x[..., 4:], x[..., :4]), dim=-1) * sin[:, None]

    def matches(c, s) -> bool:
        """The architecture's function given cos / sin as its rotary embedding makes them: full width
        (the angles twice) or half width (gpt_oss: the angles once, applied to each half)."""
        try:
            got_q, got_k = apply(q, k, c, s)[:2]
        except Exception:  # noqa: BLE001 - another signature or width: not this form
            return False
        return torch.allclose(got_q, half(q), atol=1e-5) and torch.allclose(got_k, half(k), atol=1e-5)
    if not (matches(cos, sin) or matches(angles.cos(), angles.sin())):
        raise NotNative("attention", "rotary is not rotate-half (interleaved or other): npu_apply_rotary_pos_emb "
                                     "with rotary_mode half does not compute it")


def _probe_sinks(modeling_module, attention) -> None:
    """The architecture's eager attention adds each head's sink as one more logit of its softmax and
    drops it from the weights (what npu_fused_infer_attention_score_v2's learnable_sink computes)."""
    import torch

    attend = getattr(modeling_module, "eager_attention_forward", None)
    if attend is None:
        raise NotNative("attention", "attention sinks, and no eager_attention_forward to read them from")
    gen = torch.Generator().manual_seed(5)
    heads = attention.sinks.shape[0]
    groups = getattr(attention, "num_key_value_groups", 1)
    q = torch.randn(1, heads, 3, 8, generator=gen)
    k, v = torch.randn(1, heads // groups, 3, 8, generator=gen), torch.randn(1, heads // groups, 3, 8, generator=gen)
    sinks = torch.randn(heads, generator=gen)
    causal = torch.full((3, 3), float("-inf")).triu(1)[None, None]
    saved = attention.sinks.detach().clone()
    try:
        with torch.no_grad():
            attention.sinks.copy_(sinks)
            got = attend(attention, q, k, v, causal, scaling=0.5, dropout=0.0)[0]
    except Exception as exc:  # noqa: BLE001 - another signature: not the form we know
        raise NotNative("attention", f"attention sinks: eager_attention_forward ({type(exc).__name__}) is not the known form") from exc
    finally:
        with torch.no_grad():
            attention.sinks.copy_(saved)
    scores = torch.matmul(q, k.repeat_interleave(groups, dim=1).transpose(-1, -2)) * 0.5 + causal
    scores = torch.cat([scores, sinks.view(1, heads, 1, 1).expand(1, heads, 3, 1)], dim=-1)
    want = torch.matmul(scores.softmax(-1)[..., :-1], v.repeat_interleave(groups, dim=1)).transpose(1, 2)
    if not torch.allclose(got.reshape(want.shape), want, atol=1e-5):
        raise NotNative("attention", "attention sinks enter the softmax otherwise than one logit per head")


def _rope_facts(config) -> tuple[bool, tuple[str, ...], bool]:
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        raise NotNative("attention", "no rope_parameters in the config")
    layer_types = getattr(config, "layer_types", None) or []
    by_type = bool(layer_types) and all(isinstance(params.get(t), dict) for t in set(layer_types))
    groups = [params[t] for t in sorted(set(layer_types))] if by_type else [params]
    types = tuple(sorted({g.get("rope_type", "default") for g in groups}))
    for rope_type in types:
        if rope_type not in STATIC_ROPE_TYPES:
            raise NotNative("attention", f"rope_type {rope_type!r} depends on the sequence length "
                                         f"(native: {', '.join(STATIC_ROPE_TYPES)})")
    partial = any(float(g.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0) < 1.0
                  for g in groups)
    return by_type, types, partial


def _window_rule(config, num_layers: int) -> tuple[bool, bool]:
    """(sliding, from layer_types): the generated file's rule (config.layer_types' sliding_attention
    layers, else every layer when config.sliding_window is set) checked against transformers' own cache
    decision for this config; another decision is not native."""
    from transformers.cache_utils import DynamicCache

    layers = DynamicCache(config=config).layers
    decided = [getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
               for layer in layers][:num_layers]
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    ours = [None] * num_layers
    if window:
        ours = [window if t == "sliding_attention" else None for t in types[:num_layers]] if types else [window] * num_layers
    if len(decided) != num_layers or decided != ours:
        raise NotNative("attention", f"sliding windows per layer {decided} are not config.layer_types' / "
                                     f"config.sliding_window's {ours}")
    return any(ours), bool(types)


def derive(config_dict: dict) -> NativeFeatures:
    """The features of the architecture of `config_dict` (a checkpoint's config.json, text level)."""
    import importlib

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.activations import ACT2FN

    from agent.recipe.native.moe_features import EXPERT_COUNT_KEYS

    moe = None
    if any(isinstance(config_dict.get(k), int) and config_dict[k] > 1 for k in EXPERT_COUNT_KEYS):
        from transformers import AutoConfig

        from agent.recipe.native.moe_features import derive_moe

        data = {k: v for k, v in config_dict.items() if k not in ("auto_map", "quantization_config", "architectures",
                                                                    "model_type", "transformers_version")}
        moe = derive_moe(AutoConfig.for_model(config_dict["model_type"], **data), checkpoint_keys=set(config_dict))
    config = shrunk_config(config_dict)
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - a class transformers cannot build here
        text = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        raise NotNative("model", f"transformers cannot build it on a shrunk config ({text})") from exc
    model.eval()
    modeling = importlib.import_module(type(model).__module__)
    top = _children(model)
    if set(top) - {"model", "lm_head"}:
        raise NotNative("model", f"heads other than lm_head: {sorted(set(top) - {'model', 'lm_head'})}")
    base = top.get("model")
    if base is None or set(_children(base)) - MODEL_CHILDREN:
        extra = sorted(set(_children(base)) - MODEL_CHILDREN) if base is not None else ["(no .model)"]
        raise NotNative("model", f"modules the native model does not have: {extra}")
    layers = list(base.layers)
    hidden = config.hidden_size
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    act_key = _act_key(config)
    activation = ACT2FN[getattr(config, act_key)]
    offsets, sandwich_kinds, qk_norms = set(), set(), set()
    fused_qkv = qkv_bias = fused_gate_up = False
    mla = _latent_attention(config, layers, model)   # the attention kind: MLA (None: dense / sliding window)
    sinks, o_biases = set(), set()
    for index, layer in enumerate(layers):
        kinds = _children(layer)
        unknown = set(kinds) - {"self_attn", "mlp", *LAYER_NORMS}
        if unknown:
            raise NotNative("decoder layer", f"layer {index} has {sorted(unknown)}")
        attention, mlp = kinds.get("self_attn"), kinds.get("mlp")
        if attention is None or mlp is None:
            raise NotNative("decoder layer", f"layer {index} has no self_attn / mlp")
        a = _children(attention)
        if mla is not None:
            qk_norms.add((False, False))      # latent attention: read by agent.recipe.native.mla_features
            sinks.add(False)
            o_biases.add(False)
        else:
            if set(a) - ATTENTION_CHILDREN:
                raise NotNative("attention", f"{type(attention).__name__} has {sorted(set(a) - ATTENTION_CHILDREN)}")
            sink = getattr(attention, "sinks", None)
            if sink is not None and (not isinstance(sink, torch.nn.Parameter) or tuple(sink.shape) != (heads,)):
                raise NotNative("attention", f"attention sinks of shape {tuple(getattr(sink, 'shape', ()))}: not one per head")
            sinks.add(sink is not None)
            fused_qkv = "qkv_proj" in a
            projections = [a["qkv_proj"]] if fused_qkv else [a.get("q_proj"), a.get("k_proj"), a.get("v_proj")]
            if any(p is None or not isinstance(p, torch.nn.Linear) for p in projections) or not isinstance(a.get("o_proj"), torch.nn.Linear):
                raise NotNative("attention", f"{type(attention).__name__}: q/k/v/o are not plain linears")
            o_biases.add(a["o_proj"].bias is not None)
            qkv_bias = projections[0].bias is not None
            if fused_qkv and projections[0].out_features != (heads + 2 * kv_heads) * head_dim:
                raise NotNative("attention", "qkv_proj is not [q; k; v] of the config's heads")
            if not fused_qkv and (projections[0].out_features, projections[1].out_features) != (heads * head_dim, kv_heads * head_dim):
                raise NotNative("attention", "q/k projections are not the config's heads x head_dim")
            qk_norms.add(("q_norm" in a, "k_norm" in a))
            for name in ("q_norm", "k_norm"):
                if name in a:
                    offsets.add(_probe_norm(a[name], head_dim))
        scale = getattr(attention, "scaling", None)
        if not isinstance(scale, float):
            raise NotNative("attention", f"{type(attention).__name__} has no float `scaling`")
        if moe is not None and getattr(mlp, "experts", None) is not None:
            m = None          # the sparse-MoE block: probed by derive_moe
        else:
            m = _children(mlp)
        if m is None:
            pass
        elif set(m) - MLP_CHILDREN or "down_proj" not in m or not ({"gate_proj", "up_proj"} <= set(m) or "gate_up_proj" in m):
            raise NotNative("mlp", f"{type(mlp).__name__} ({sorted(m)}) is not a gated MLP")
        if m is not None and any(getattr(p, "bias", None) is not None for p in m.values() if isinstance(p, torch.nn.Linear)):
            raise NotNative("mlp", "MLP projections with biases")
        if m is not None:
            fused_gate_up = "gate_up_proj" in m
            _probe_mlp(mlp, hidden, activation)
        present = tuple(n for n in LAYER_NORMS if n in kinds)
        if present not in (LAYER_NORMS[:2], LAYER_NORMS):
            raise NotNative("decoder layer", f"norms {present}: neither pre-norm nor sandwich")
        sandwich_kinds.add(present == LAYER_NORMS)
        for name in present:
            offsets.add(_probe_norm(kinds[name], hidden))
    offsets.add(_probe_norm(base.norm, hidden))
    if len(offsets) != 1 or len(sandwich_kinds) != 1 or len(qk_norms) != 1 or next(iter(qk_norms)) not in ((True, True), (False, False)) \
            or len(sinks) != 1 or len(o_biases) != 1:
        raise NotNative("decoder layer", "layers of unequal structure")
    # the attention's softmax scale: head_dim ** -0.5 or query_pre_attn_scalar ** -0.5
    scales = {"head_dim": head_dim ** -0.5}
    if isinstance(getattr(config, "query_pre_attn_scalar", None), (int, float)):
        scales["query_pre_attn_scalar"] = config.query_pre_attn_scalar ** -0.5
    scaling = next((name for name, value in scales.items() if math.isclose(layers[0].self_attn.scaling, value, rel_tol=1e-6)), None)
    if mla is not None:
        scaling = "mla"            # MlaFeatures.scale: probed with the whole attention
    elif scaling is None:
        raise NotNative("attention", f"softmax scale {layers[0].self_attn.scaling} is neither head_dim ** -0.5 "
                                     "nor query_pre_attn_scalar ** -0.5")
    embed_scale = _probe_embed_scale(model, base, hidden)
    if mla is None:
        _probe_rotary(modeling)
    by_type, rope_types, partial = _rope_facts(config)
    sliding, from_types = _window_rule(config, len(layers))
    attn_softcap = getattr(config, "attn_logit_softcapping", None) is not None
    attn_sinks = next(iter(sinks))
    if attn_sinks:
        _probe_sinks(modeling, layers[0].self_attn)
    if attn_sinks and attn_softcap:
        raise NotNative("attention", "attention sinks with soft-capped logits: neither the fused attention nor the "
                                     "plain-torch one computes both")
    final_softcap = getattr(config, "final_logit_softcapping", None) is not None
    tied = bool(getattr(config, "tie_word_embeddings", False))
    offset = next(iter(offsets))
    swiglu = activation.__class__.__name__ == "SiLUActivation" or getattr(config, act_key) in ("silu", "swish")
    unfused = []
    fused = ["npu_scatter_nd_update_ (paged KV write)",
             "npu_apply_rotary_pos_emb (TND, rotate-half" + (", on the rotary slice" if partial else "") + ")"]
    fused.append("npu_rms_norm / npu_add_rms_norm (residual add fused)" +
                 (", gemma's 1 + w folded into the weight after loading" if offset else ""))
    if mla is not None:
        # MLA writes its latent caches and rotates by its own kernels: no q/k/v scatter, no rotate-half op
        fused = [item for item in fused if not item.startswith(("npu_scatter_nd_update_", "npu_apply_rotary_pos_emb"))]
        fused.extend(mla.fused)
        unfused.extend(mla.unfused)
    elif attn_softcap:
        unfused.append("attention: plain torch over the paged cache (logit soft-capping: "
                       "npu_fused_infer_attention_score has no soft-cap); a decode step gathers the "
                       + ("window's blocks on sliding-window layers and " if sliding else "")
                       + "the block table's width on full-attention layers (one shape for graph mode)")
    else:
        fused.append("npu_fused_infer_attention_score_v2 (TND, paged cache through block_table"
                     + ("; sliding-window layers: band mode (sparse_mode 4) at prefill and, on the "
                        "window's blocks alone, at decode" if sliding else "")
                     + ("; attention sinks as its learnable_sink" if attn_sinks else "") + ")")
    if moe is not None and moe.sparse_rule == "all":
        pass                      # no dense MLP layer: the experts' activation is the MoE block's
    elif swiglu:
        fused.append("npu_swiglu (gate/up)")
    else:
        unfused.append(f"MLP activation {getattr(config, act_key)} * up: plain torch (npu_swiglu is silu only)")
    if embed_scale != "unscaled":
        unfused.append("embedding scale sqrt(hidden_size): plain torch multiply")
    if final_softcap:
        unfused.append("final logit soft-capping: plain torch tanh")
    return NativeFeatures(
        model_type=config.model_type, fused_qkv=fused_qkv, qkv_bias=qkv_bias, qk_norm=next(iter(qk_norms))[0],
        fused_gate_up=fused_gate_up, activation=getattr(config, act_key), act_key=act_key, norm_offset=offset,
        sandwich=next(iter(sandwich_kinds)), embed_scale=embed_scale, scaling=scaling, rope_by_layer_type=by_type,
        rope_types=rope_types, partial_rotary=partial, sliding=sliding, windows_from_layer_types=from_types,
        attn_softcap=attn_softcap, final_softcap=final_softcap, tie_word_embeddings=tied, attn_sinks=attn_sinks,
        o_bias=next(iter(o_biases)),
        fused=tuple(fused) + (moe.fused if moe else ()), unfused=tuple(unfused) + (moe.unfused if moe else ()), moe=moe,
        mla=mla)


def _latent_attention(config, layers, model):
    """MlaFeatures when the layers' attention is multi-head latent attention (agent.recipe.native.mla_features),
    None when it is not; a mix is not native."""
    from agent.recipe.native.mla_features import derive_mla, is_mla

    kinds = {is_mla(set(_children(layer.self_attn))) for layer in layers if hasattr(layer, "self_attn")}
    if kinds == {True}:
        return derive_mla(config, layers, model, _probe_norm)
    if len(kinds) > 1:
        raise NotNative("attention", "latent (MLA) and other attention layers in one model (linear, dense)")
    return None


def _probe_embed_scale(model, base, hidden: int) -> str:
    """What the model does between the embedding lookup and the first layer: nothing, or times
    sqrt(hidden_size) (gemma's normaliser, in the model's dtype)."""
    import torch

    seen = {}
    def keep(module, args, kwargs):
        seen.setdefault("x", (args[0] if args else kwargs["hidden_states"]).detach())

    handle = base.layers[0].register_forward_pre_hook(keep, with_kwargs=True)
    ids = torch.tensor([[3, 5, 7]])
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    table = base.embed_tokens.weight.detach()[ids[0]]
    got = seen["x"].reshape(table.shape)
    if torch.allclose(got, table, rtol=1e-5, atol=1e-6):
        return "unscaled"
    if torch.allclose(got, table * torch.tensor(hidden ** 0.5, dtype=table.dtype), rtol=1e-5, atol=1e-6):
        return "sqrt_hidden"
    raise NotNative("model", "the embedding is scaled by something other than 1 or sqrt(hidden_size)")
