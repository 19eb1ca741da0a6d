"""Attention over the paged KV cache: fused (npu_fused_infer_attention_score_v2; full or sliding-window layers),
with attention sinks (its learnable_sink), soft-capped logits in plain torch (no fused kernel soft-caps), and
multi-head latent attention (agent.recipe.native.parts.mla). What the layers' attention modules are is read from
them: separate or fused q/k/v, biases (literal, or set by a config key: the key toggled, the bias appears), q/k
norms, the softmax scale, sinks, and the sliding windows as transformers' own cache decides them, for the
checkpoint's config and for one with a window toggled."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.attention_gate import GATE_NAMES, gate_kernel, output_gate, renames as gate_renames
from agent.recipe.native.parts.attention_head_dim import layer_head_dim
from agent.recipe.native.parts.attention_heads import heads_per_layer, key_heads_by_kind, layer_heads, layer_key_heads
from agent.recipe.native.parts.attention_k_eq_v import keys_as_values
from agent.recipe.native.parts.attention_params import (DENSE_BIAS_RENAMES, GATE_BIAS_RENAMES, last_layer_output_bias,
                                                        refuse_unknown)
from agent.recipe.native.parts.attention_key_scale import key_scale
from agent.recipe.native.parts.attention_value_scale import value_scale
from agent.recipe.native.parts.attention_chunked import SMALL_CHUNK, chunked_attention, small_chunk_setting
from agent.recipe.native.parts.attention_positions import SMALL_ORIGINAL, query_position_scale, small_original_setting
from agent.recipe.native.parts.attention_temperature import SMALL_FLOOR, query_temperature, small_floor_setting
from agent.recipe.native.parts.attention_ssmax import ssmax_query_scale
from agent.recipe.native.parts.attention_qk_l2 import QK_L2_KEY, QK_L2_NAME, qk_l2_norm
from agent.recipe.native.parts.part import Expr, Match, Part
from agent.recipe.native.parts.mla import is_mla_model
from agent.recipe.native.parts.probe import DROP, children, multi_query
from agent.recipe.native.parts.sub_norm import ATTN_SUB_NORM, attention_sub_norm

# the q / k norms' names (a rename: hunyuan's query_layernorm / key_layernorm, persimmon's and phi's q_layernorm /
# k_layernorm are qwen3's q_norm / k_norm)
QK_NORM_NAMES = (("q_norm", "k_norm"), ("query_layernorm", "key_layernorm"), ("q_layernorm", "k_layernorm"))
ATTENTION_CHILDREN = {"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "rotary_fn", "v_norm", *sum(QK_NORM_NAMES, ()),
                      *GATE_NAMES, ATTN_SUB_NORM}
BIAS_KEYS = ("attention_bias", "use_qkv_bias", "use_bias", "enable_bias")       # config keys that may set the projections' biases
DENSE_OPTIONS = ("QKV", "QKV_BIAS", "O_BIAS", "QK_NORM", "QK_NORM_FULL", "QUERY_PRE_ATTN_SCALAR", "WINDOWS",
                 "LAYER_TYPE_WINDOWS", "STACKED_PARAMS", "ATTENTION_MULTIPLIER", "ROTARY", "UNSCALED", "LOCAL_LAYERS",
                 "OUTPUT_GATE", "Q_NORM", "K_NORM", "QK_NORM_AFTER_ROPE", "QK_L2_NORM", "QKV_GROUPS", "MULTI_QUERY",
                 "GATE_PROJ", "GATE_SOFTPLUS", "GATE_PER_HEAD", "CHECKPOINT_RENAMES", "ATTN_SUB_NORM", "GATE_BIAS",
                 "HEADS_PER_LAYER", "QUERY_POSITION_SCALE", "FULL_LAYERS_WINDOWED", "HEAD_DIM_PER_LAYER", "V_NORM",
                 "KV_HEADS_BY_LAYER_TYPE", "SINK_LAYER_TYPES", "V_HEAD_DIM", "VALUE_SCALE", "KEY_SCALE", "KV_HEADS_PER_LAYER",
                 "K_EQ_V", "WINDOW_DECODE_ONLY", "QUERY_TEMPERATURE", "CHUNKED", "QUERY_SSMAX")
WINDOW = 5                            # the shrunk window (agent.recipe.native.parts.probe.shrunk_config)


def attention_layers(probe) -> list[int]:
    """The layers with a softmax attention (a hybrid's others hold linear_attn: parts/linear_attention.py)."""
    return [index for index, layer in enumerate(probe.layers) if hasattr(layer, "self_attn")]


def _projections(probe, index: int | None = None):
    """(q/k/v linears, o_proj) of layer `index`'s attention (the first attention layer's by default)."""
    index = attention_layers(probe)[0] if index is None else index
    a = children(probe.layers[index].self_attn)
    qkv = [a["qkv_proj"]] if "qkv_proj" in a else [a.get("q_proj"), a.get("k_proj"), a.get("v_proj")]
    return qkv, a.get("o_proj")


def _bias_option(probe, present: bool, which: str):
    """A projection group's bias: Expr(config.<key>) where a key toggles it, else the literal."""
    import torch

    for key in BIAS_KEYS:
        value = probe.config.to_dict().get(key)
        if not isinstance(value, bool):
            continue
        try:
            other = probe.variant({key: not value})
        except NotNative:
            continue
        qkv, o = _projections(other)
        module = qkv[0] if which == "qkv" else o
        toggled = isinstance(getattr(module, "bias", None), torch.Tensor)
        if toggled != present and present == value:
            return Expr(f"config.{key}")
    return present


def window_rule(config, num_layers: int) -> tuple[bool, bool]:
    """(sliding, from layer_types): the generated file's rule (config.layer_types' sliding_attention layers,
    else every layer when config.sliding_window is set) checked against transformers' own cache decision for
    this config; another decision is not native."""
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


def _window_changes(probe, on: bool) -> dict:
    """Config changes that turn the checkpoint's sliding windows on (a window, the switches that enable it, the
    layer kinds recomputed from them) or off."""
    data = probe.config_dict
    if not on:
        return {"sliding_window": None, **({"use_sliding_window": False} if "use_sliding_window" in data else {})}
    changes = {"sliding_window": 4096}
    if "use_sliding_window" in data:
        # qwen2's switches: its layer kinds follow from them (dropped, transformers derives them again)
        changes.update(use_sliding_window=True, max_window_layers=1, layer_types=DROP)
    return changes


def _logits(probe):
    import torch

    ids = (torch.arange(2 * WINDOW + 2) * 7 + 3)[None] % probe.config.vocab_size
    with torch.no_grad():
        return probe.model(input_ids=ids, use_cache=False).logits


def mask_ignores_window(probe) -> bool:
    """Whether transformers' whole-sequence logits (no cache: its mask alone) are the same with the config's shrunk
    window as with one as long as the input (the probe's weights, the config copied with that window: a variant
    shrinks every window to WINDOW); False where it cannot build or run the longer window."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(probe.config)
    config.sliding_window = 2 * WINDOW + 2
    ids = (torch.arange(2 * WINDOW + 2) * 7 + 3)[None] % probe.config.vocab_size
    try:
        longer = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        longer.load_state_dict(probe.model.state_dict())
        with torch.no_grad():
            return torch.allclose(longer(input_ids=ids, use_cache=False).logits, _logits(probe), atol=1e-6)
    except Exception:  # noqa: BLE001 - a config the architecture refuses: not this reading's to judge
        return False


def _toggled(probe, on: bool):
    """The probe with the window toggled, or None where transformers does not build or run that config."""
    try:
        other = probe.variant(_window_changes(probe, on))
        _logits(other)
    except Exception:  # noqa: BLE001 - a config the architecture refuses: no such checkpoint to serve
        return None
    return other


def measured_scale(attention, qkv, o, heads: int, head_dim: int) -> float | None:
    """The softmax scale of an attention without a `scaling` attribute and without rotary (positions added to the
    embedding), measured: its output on 4 tokens against causal attention at head_dim ** -0.5 and at 1; None for
    neither (or another call shape). `qkv`: the q, k, v linears, or one fused [q; k; v] (openai-gpt's c_attn)."""
    import torch

    width = qkv[0].in_features if isinstance(qkv[0], torch.nn.Linear) else getattr(qkv[0], "nx", None)
    if width is None:
        return None
    x = torch.randn(1, 4, width, generator=torch.Generator().manual_seed(11))
    try:
        with torch.no_grad():
            got = attention(x)
    except Exception:  # noqa: BLE001 - another call shape: not measured
        return None
    got = got[0] if isinstance(got, (tuple, list)) else got
    with torch.no_grad():
        if len(qkv) == 3:
            projected = [p(x) for p in qkv]
        else:
            kv_width = (out_features(qkv[0]) - heads * head_dim) // 2
            projected = qkv[0](x).split([heads * head_dim, kv_width, kv_width], dim=-1)
        q, k, v = (t.reshape(1, 4, -1, head_dim).transpose(1, 2) for t in projected)
        groups = heads // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        causal = torch.full((4, 4), float("-inf")).triu(1)
        for scale in (head_dim ** -0.5, 1.0):
            weights = (q @ k.transpose(-1, -2) * scale + causal).softmax(-1)
            want = o((weights @ v).transpose(1, 2).reshape(1, 4, -1))
            if torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                return scale
    return None


def local_layers(probe) -> dict | None:
    """gpt_neo's windows: config.attention_layers' "local" layers attend to the last config.window_size keys, read
    from each layer's own causal mask (key j seen by query i where j <= i and i - j < window_size); None for a
    config without them."""
    import torch

    config = probe.config
    kinds, window = getattr(config, "attention_layers", None), getattr(config, "window_size", None)
    if not isinstance(kinds, list) or not isinstance(window, int):
        return None
    n = 2 * window + 2
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    for index, layer in enumerate(probe.layers):
        mask = getattr(children(layer)["self_attn"], "bias", None)
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape[-1] < n:
            raise NotNative("attention", "config.attention_layers, and no causal mask buffer to read the windows from")
        want = (j <= i) & ((i - j < window) if kinds[index] == "local" else True)
        if not torch.equal(mask[0, 0, :n, :n], want):
            raise NotNative("attention", f"layer {index}'s mask is not the {kinds[index]} attention of "
                                         "config.attention_layers / window_size")
    return {"WINDOWS": True, "LAYER_TYPE_WINDOWS": False, "LOCAL_LAYERS": True}


def windows(probe) -> dict:
    """WINDOWS (the architecture attends in a window where the config sets one) and LAYER_TYPE_WINDOWS (which
    layers: config.layer_types'), held to transformers' own cache decision on the checkpoint's config and on one
    with the window toggled (which the self-check then runs too)."""
    import torch

    local = local_layers(probe)
    if local is not None:
        return local
    if "sliding_window" not in probe.config.to_dict():
        return {"WINDOWS": False, "LAYER_TYPE_WINDOWS": False}
    sliding, from_types = window_rule(probe.config, len(probe.layers))
    other = _toggled(probe, not sliding)
    if other is not None:
        attends = not torch.allclose(_logits(other), _logits(probe), atol=1e-6)
        if attends:
            other_sliding, other_types = window_rule(other.config, len(other.layers))
            sliding, from_types = sliding or other_sliding, from_types or other_types
    elif not sliding:
        return {"WINDOWS": False, "LAYER_TYPE_WINDOWS": False}
    elif mask_ignores_window(probe):
        # the window in transformers' cache alone (moshi: its config cannot turn the window off, its mask is causal,
        # its DynamicSlidingWindowLayer keeps the last window - 1 keys): a prefill attends to the whole prompt, a
        # decode step to the window
        return {"WINDOWS": True, "LAYER_TYPE_WINDOWS": from_types, "WINDOW_DECODE_ONLY": True}
    else:
        attends = True
    if not attends:
        if sliding:
            raise NotNative("attention", "a sliding window in the config that the model does not attend by")
        return {"WINDOWS": False, "LAYER_TYPE_WINDOWS": False}
    facts = {"WINDOWS": True, "LAYER_TYPE_WINDOWS": from_types}
    if not sliding and from_types:
        # the model attends by the window, though its cache and layer_types name no sliding layer: its mask windows the
        # full_attention layers (minimax's; its linear_attention layers hold no cache)
        facts["FULL_LAYERS_WINDOWED"] = True
    if other is not None:
        facts["toggle"] = _window_changes(probe, not bool(getattr(probe.config, "sliding_window", None)))
    return facts


def _words(text):
    return field(metadata={"words": text})


@dataclass(frozen=True)
class LayerAttention:
    """One attention layer's properties the file writes once for every layer (each field's words: the error's)."""
    fused: bool = _words("fused q/k/v")
    qkv_bias: bool = _words("q/k/v bias")
    o_bias: bool = _words("o_proj bias")
    qk_width: str | None = _words("q/k norm width")
    qk_names: tuple = _words("q/k norm names")
    scale: float = _words("softmax scale")
    gated: bool = _words("output gate in q_proj")
    grouped: tuple = _words("q/k/v groups")
    gate: tuple = _words("output gate")
    sub_norm: object = _words("sub-norm")
    value_dim: object = _words("value head width")
    v_norm: object = _words("value norm")


def dense_attention(probe) -> dict:
    """The dense attention's facts (memoised on the probe); NotNative for one the fused kernels cannot run."""
    if "dense_attention" in probe.memo:
        return probe.memo["dense_attention"]
    import torch

    heads, kv_heads, head_dim = probe.heads, probe.kv_heads, probe.head_dim
    shapes, with_sinks = set(), set()
    if not attention_layers(probe):
        raise NotNative("attention", "no layer has self_attn (linear attention only): the generated file writes "
                                     "linear-attention layers beside softmax-attention ones")
    per_layer = heads_per_layer(probe)
    head_dims = {index: layer_head_dim(probe, index) for index in attention_layers(probe)}
    kinds_heads = key_heads_by_kind(probe)
    k_eq_v = keys_as_values(probe)
    qk_l2 = qk_l2_norm(probe, attention_layers(probe))
    for index in attention_layers(probe):
        heads, kv_heads = layer_heads(probe, index), layer_key_heads(probe, index)
        head_dim = head_dims[index]
        attention = probe.layers[index].self_attn
        a = children(attention)
        if qk_l2:
            a.pop(QK_L2_NAME, None)         # llama4's, read above: on the layers that rotate
        if set(a) - ATTENTION_CHILDREN:
            raise NotNative("attention", f"{type(attention).__name__} has {sorted(set(a) - ATTENTION_CHILDREN)}")
        # beam's gate_bias, gpt_neox_japanese's last-layer dense_bias: read below (parts/attention_params.py)
        refuse_unknown(attention)
        sink = getattr(attention, "sinks", None)
        if sink is not None and (not isinstance(sink, torch.nn.Parameter) or tuple(sink.shape) != (heads,)):
            raise NotNative("attention", f"attention sinks of shape {tuple(getattr(sink, 'shape', ()))}: not one per head")
        qkv, o = _projections(probe, index)
        if k_eq_v and len(qkv) == 3 and qkv[2] is None:
            qkv = [qkv[0], qkv[1], qkv[1]]          # its values are k_proj's output (parts/attention_k_eq_v.py)
        if any(out_features(p) is None for p in qkv) or out_features(o) is None:
            raise NotNative("attention", f"{type(attention).__name__}: q/k/v/o are not plain linears")
        fused = "qkv_proj" in a
        if fused and out_features(qkv[0]) != (heads + 2 * kv_heads) * head_dim:
            raise NotNative("attention", "qkv_proj is not [q; k; v] of the config's heads")
        grouped = fused_qkv_groups(probe, index, qkv[0], o) if fused and not per_layer else ()
        # an output gate: q_proj holds each head's query and its gate side by side (qwen3_next)
        gated = not fused and out_features(qkv[0]) == 2 * heads * head_dim and output_gated(attention, probe, heads)
        gate = output_gate(attention, probe, heads)   # a gate from a projection of its own (afmoe, laguna)
        if gate is not None and gated:
            raise NotNative("attention", "an output gate in q_proj and another from its own projection")
        if not fused and (out_features(qkv[0]) // (2 if gated else 1), out_features(qkv[1])) != (heads * head_dim,
                                                                                                    kv_heads * head_dim):
            widths = (out_features(qkv[0]) // (2 if gated else 1), out_features(qkv[1]))
            held = (f"{widths[0] // head_dim} query / {widths[1] // head_dim} key heads of head_dim {head_dim}"
                    if not (widths[0] % head_dim or widths[1] % head_dim) else f"{widths[0]} / {widths[1]} rows")
            raise NotNative("attention", f"layer {index}'s q/k projections are {held}, not the config's {heads} / "
                                         f"{kv_heads} heads x head_dim {head_dim}{key_heads_in_words(probe, index)}")
        value_dim = None if fused else value_head_dim(probe, qkv[2], o, heads, kv_heads, head_dim)
        pairs = [pair for pair in QK_NORM_NAMES if pair[0] in a or pair[1] in a]
        if len(pairs) > 1 or (pairs and not (pairs[0][0] in a and pairs[0][1] in a)):
            raise NotNative("attention", "a q norm without a k norm, or the reverse")
        qk_names = pairs[0] if pairs else QK_NORM_NAMES[0]
        qk_width = qk_norm_width(a, heads, kv_heads, head_dim, qk_names) if pairs else None
        scale = getattr(attention, "scaling", None)
        if scale is None:
            scale = getattr(attention, "inv_norm_factor", None)           # falcon's name of it
        if scale is None and isinstance(getattr(attention, "norm_factor", None), float):
            scale = 1.0 / attention.norm_factor                      # gpt_neox_japanese's: q . k / sqrt(head_dim)
        if scale is None and probe.memo.get("alibi"):
            scale = alibi_scale(attention)
        if scale is None and probe.layout is not None:
            scale = measured_scale(attention, qkv, o, heads, head_dim)        # gpt_neo's, openai-gpt's: no `scaling`
        if not isinstance(scale, float):
            raise NotNative("attention", f"{type(attention).__name__} has no float `scaling`")
        if math.isclose(scale, head_dim ** -0.5, rel_tol=1e-6):
            # the head_dim rule, each layer by its own head_dim (gemma4's per-layer widths): one rule, read
            # below on the first attention layer's width
            scale = head_dims[attention_layers(probe)[0]] ** -0.5
        if sink is not None:
            with_sinks.add(index)
        shapes.add(LayerAttention(fused, qkv[0].bias is not None, o.bias is not None, qk_width, qk_names, scale,
                                  gated, grouped, tuple(sorted((gate or {}).items())), attention_sub_norm(probe, index),
                                  value_dim, value_norm(a.get("v_norm"), head_dim, probe.config)))
    if len(shapes) != 1:
        differ = [f.metadata["words"] for f in fields(LayerAttention)
                  if len({getattr(shape, f.name) for shape in shapes}) > 1]
        raise NotNative("attention", f"layers of unequal attention ({', '.join(differ)})")
    sinks = bool(with_sinks)
    sink_kinds = sink_layer_kinds(probe, with_sinks) if with_sinks != set(attention_layers(probe)) and sinks else ()
    position_scaled = query_position_scale(probe, attention_layers(probe)[0])
    temperature, chunked = query_temperature(probe), chunked_attention(probe)
    (shape,) = shapes
    fused, qkv_bias, o_bias, qk_width, qk_names = (shape.fused, shape.qkv_bias, shape.o_bias, shape.qk_width,
                                                   shape.qk_names)
    scale, gated, grouped, gate, sub_norm = shape.scale, shape.gated, shape.grouped, shape.gate, shape.sub_norm
    value_dim, v_norm = shape.value_dim, shape.v_norm
    head_dim = head_dims[attention_layers(probe)[0]]
    after_rope = qk_width is not None and qk_norm_after_rope(probe, qk_names[0])
    if after_rope and qk_width == "full":
        raise NotNative("attention", "q/k norms over all heads' width after the rotary")
    if qk_width == "full" and fused:
        raise NotNative("attention", "q/k norms over all heads' width with a fused qkv_proj")
    scales = {"head_dim": head_dim ** -0.5, "unscaled": 1.0}
    if isinstance(getattr(probe.config, "query_pre_attn_scalar", None), (int, float)):
        scales["query_pre_attn_scalar"] = probe.config.query_pre_attn_scalar ** -0.5
    if isinstance(getattr(probe.config, "attention_multiplier", None), (int, float)):
        scales["attention_multiplier"] = float(probe.config.attention_multiplier)     # granite's softmax scale
    rules = [name for name, value in scales.items() if math.isclose(scale, value, rel_tol=1e-6)]
    if len(rules) > 1 and "attention_multiplier" in rules:
        # the checkpoint's attention_multiplier is head_dim ** -0.5 (hyperclovax's default): whether the scale
        # follows the key is read on another value of it
        other = probe.variant({"attention_multiplier": 0.5 * scales["attention_multiplier"]})
        follows = math.isclose(other.layers[attention_layers(other)[0]].self_attn.scaling, 0.5 * scales["attention_multiplier"], rel_tol=1e-6)
        rules = ["attention_multiplier"] if follows else [r for r in rules if r != "attention_multiplier"]
    rule = rules[0] if rules else None
    if rule is None:
        raise NotNative("attention", f"softmax scale {scale} is none of head_dim ** -0.5, query_pre_attn_scalar ** -0.5, "
                                     "attention_multiplier")
    if sinks:
        _probe_sinks(probe.modeling, probe.layers[min(with_sinks)].self_attn)
    stacked = () if fused else (("merged_qkv_proj", "q_proj", "q"), ("merged_qkv_proj", "k_proj", "k"),
                                ("merged_qkv_proj", "v_proj", "v"))
    facts = {"QKV": "qkv_proj" if fused else "merged_qkv_proj", "QKV_BIAS": _bias_option(probe, qkv_bias, "qkv"),
             "O_BIAS": _bias_option(probe, o_bias, "o"), "QK_NORM": qk_width == "head",
             "QK_NORM_FULL": qk_width == "full",
             "QUERY_PRE_ATTN_SCALAR": rule == "query_pre_attn_scalar", "STACKED_PARAMS": stacked,
             "ATTENTION_MULTIPLIER": rule == "attention_multiplier", "UNSCALED": rule == "unscaled",
             "OUTPUT_GATE": gated,
             "sinks": sinks, **({"QKV_GROUPS": grouped} if grouped else {}), **windows(probe)}
    if multi_query(probe.config):
        facts["MULTI_QUERY"] = True
    if sink_kinds:
        facts["SINK_LAYER_TYPES"] = sink_kinds
    if value_dim == "v_head_dim":
        if gated or gate or sub_norm or per_layer:
            raise NotNative("attention", "value heads of config.v_head_dim with an output gate, a sub-norm or query "
                                         "heads per layer: not written")
        facts["V_HEAD_DIM"] = True
    if value_scale(probe):
        facts["VALUE_SCALE"] = value_scale(probe)
    if key_scale(probe):
        facts["KEY_SCALE"] = key_scale(probe)
    if kinds_heads:
        if fused or per_layer:
            raise NotNative("attention", "key/value heads per layer kind with a fused qkv_proj or query heads per "
                                         "layer: not written")
        facts.update(KV_HEADS_BY_LAYER_TYPE=kinds_heads[0], kv_heads_variant=kinds_heads[1])
    if per_layer:
        if fused or sinks:
            raise NotNative("attention", f"query heads per layer (config.{per_layer[0]}) with a fused qkv_proj or "
                                         "attention sinks: not written")
        facts.update(HEADS_PER_LAYER=per_layer[0], heads_variant=per_layer[1])
    if v_norm:
        if fused or gated:
            raise NotNative("attention", "a value norm with a fused qkv_proj or a gate in q_proj: not written")
        facts["V_NORM"] = True
    if len(set(head_dims.values())) > 1:
        if fused or grouped or gated or sinks or qk_width == "full":
            raise NotNative("attention", "head_dim per layer (per_layer_config) with a fused qkv_proj, a gate in "
                                         "q_proj, attention sinks or q/k norms over all heads: not written")
        facts["HEAD_DIM_PER_LAYER"] = True
    if getattr(probe, "layer_kv_heads", None):
        # the config sets them per layer (a global read of them is refused): each layer reads its own
        if fused or grouped or per_layer or qk_width == "full":
            raise NotNative("attention", "key/value heads per layer (per_layer_config) with a fused qkv_proj, query "
                                         "heads per layer or q/k norms over all heads: not written")
        facts["KV_HEADS_PER_LAYER"] = True
    if k_eq_v:
        if fused or grouped or value_dim:
            raise NotNative("attention", "keys as values with a fused qkv_proj or narrower value heads: not written")
        facts["K_EQ_V"] = k_eq_v
    if sub_norm:
        facts["ATTN_SUB_NORM"] = True
    if gate:
        facts.update(dict(gate), CHECKPOINT_RENAMES=gate_renames(dict(gate)["GATE_PROJ"]) +
                     (GATE_BIAS_RENAMES if dict(gate).get("GATE_BIAS") else ()))
    last_bias = last_layer_output_bias(probe, attention_layers(probe))
    if last_bias:
        if o_bias:
            raise NotNative("attention", "o_proj with a bias and a dense_bias of its own on the last layer")
        facts.update(last_bias, CHECKPOINT_RENAMES=facts.get("CHECKPOINT_RENAMES", ()) + DENSE_BIAS_RENAMES)
    if qk_names != QK_NORM_NAMES[0]:
        facts.update({"Q_NORM": qk_names[0], "K_NORM": qk_names[1]})
    if after_rope:
        facts["QK_NORM_AFTER_ROPE"] = True
    if position_scaled:
        facts["QUERY_POSITION_SCALE"] = True
    if temperature:
        facts["QUERY_TEMPERATURE"] = True
    if ssmax_query_scale(probe):
        facts["QUERY_SSMAX"] = True
    if chunked:
        if facts.get("WINDOWS") or per_layer or kinds_heads:
            raise NotNative("attention", "chunked local attention beside sliding windows or heads per layer: not "
                                         "written")
        facts["CHUNKED"] = True
    if qk_l2:
        facts["QK_L2_NORM"] = True
    probe.memo["dense_attention"] = facts
    return facts


def value_head_dim(probe, v_proj, o_proj, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """None where the value heads are the layer's head_dim wide (v_proj of kv_heads x head_dim rows); "v_head_dim"
    where they are config.v_head_dim's, narrower (mimo_v2_flash: 128 beside 192), o_proj taking heads x v_head_dim, and
    following the key on a config with it halved; NotNative otherwise."""
    width = out_features(v_proj)
    if width == kv_heads * head_dim:
        return None
    v_head_dim = getattr(probe.config, "v_head_dim", None)

    def follows(config_probe, dim) -> bool:
        attention = config_probe.layers[attention_layers(config_probe)[0]].self_attn
        kv = out_features(attention.k_proj) // config_probe.head_dim
        return (out_features(attention.v_proj), attention.o_proj.in_features) == (kv * dim, config_probe.heads * dim)

    if isinstance(v_head_dim, int) and 0 < v_head_dim < head_dim and v_head_dim % 2 == 0 and \
            (width, getattr(o_proj, "in_features", None)) == (kv_heads * v_head_dim, heads * v_head_dim):
        try:
            confirmed = follows(probe.variant({"v_head_dim": v_head_dim // 2}), v_head_dim // 2)
        except Exception:  # noqa: BLE001 - a config the architecture refuses: the key not confirmed
            confirmed = False
        if confirmed:
            return "v_head_dim"
    raise NotNative("attention", f"v_proj of {width} rows: not {kv_heads} value heads of head_dim {head_dim}"
                                 + (f" nor of config.v_head_dim {v_head_dim} (o_proj beside them)" if v_head_dim else ""))


def key_heads_in_words(probe, index: int) -> str:
    """Where layer `index`'s key/value heads are a multiple of the config's shared by every layer of its kind
    (config.layer_types; mimo_v2_flash's sliding layers: twice), that rule in words (no config key the file reads
    sets it); else ""."""
    kinds, head_dim = getattr(probe.config, "layer_types", None), probe.head_dim
    if not isinstance(kinds, list) or len(kinds) < len(probe.layers):
        return ""
    ratios = {}
    for layer in attention_layers(probe):
        width = out_features(_projections(probe, layer)[0][1])
        if not width or width % (probe.kv_heads * head_dim):
            return ""
        ratios.setdefault(kinds[layer], set()).add(width // (probe.kv_heads * head_dim))
    kind = kinds[index]
    if len(ratios[kind]) != 1 or ratios[kind] == {1}:
        return ""
    return (f" (every {kind} layer has {next(iter(ratios[kind]))} x num_key_value_heads, which the architecture's code "
            "sets, not a config key: the file builds every layer with num_key_value_heads)")


def out_features(projection) -> int | None:
    """The output width of a Linear or of a Conv1D (gpt2's: a linear whose weight is stored [in, out], transposed
    at load: agent.recipe.native.parts.layout); None for anything else."""
    import torch
    from transformers.pytorch_utils import Conv1D

    if isinstance(projection, torch.nn.Linear):
        return projection.out_features
    return projection.nf if isinstance(projection, Conv1D) else None


# the grouped layouts of fused q/k/v rows the file reorders at load: (groups, the order of each group's sections)
QKV_LAYOUTS = (("kv_heads", "qkv"), (4, "qvk"))


def fused_qkv_groups(probe, index: int, qkv, o) -> tuple:
    """How layer `index`'s fused q/k/v rows are stored: (), [q; k; v] (phi3); else a layout of QKV_LAYOUTS: per
    key/value head [its queries; key; value] (gpt_neox, persimmon: per head [q; k; v]), codegen's 4 shards of
    [q; v; k]. Read from one token at position 0, whose attention output (o_proj's input) is its own value rows,
    each query head its group's (the q / k order the self-check holds); another is not native."""
    import torch

    heads, kv_heads, head_dim = probe.heads, probe.kv_heads, probe.head_dim
    seen = {}

    def keep_input(module, args, kwargs):
        seen.setdefault("x", (args[0] if args else kwargs["hidden_states"]).detach())

    def keep_output(module, args):
        seen.setdefault("out", args[0].detach())

    hooks = [probe.layers[index].self_attn.register_forward_pre_hook(keep_input, with_kwargs=True),
             o.register_forward_pre_hook(keep_output)]
    try:
        with torch.no_grad():
            probe.model(input_ids=torch.tensor([[3]]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    weight = qkv.weight if isinstance(qkv, torch.nn.Linear) else qkv.weight.t()        # a Conv1D's is [in, out]
    with torch.no_grad():
        rows = torch.nn.functional.linear(seen["x"], weight, qkv.bias).reshape(-1)     # the stored rows' output
    got = seen["out"].reshape(heads, head_dim)
    candidates = [((), rows[(heads + kv_heads) * head_dim:])]
    for count, order in QKV_LAYOUTS:
        groups = kv_heads if count == "kv_heads" else count
        if heads % groups or kv_heads % groups:
            continue
        sizes = {"q": heads * head_dim // groups, "k": kv_heads * head_dim // groups, "v": kv_heads * head_dim // groups}
        sections = dict(zip(order, rows.reshape(groups, -1).split([sizes[name] for name in order], dim=1)))
        candidates.append(((count, order), sections["v"]))
    for layout, value in candidates:
        value = value.reshape(kv_heads, head_dim).repeat_interleave(heads // kv_heads, dim=0)
        if torch.allclose(got, value, rtol=1e-4, atol=1e-5):
            return layout
    raise NotNative("attention", "fused q/k/v rows neither [q; k; v] nor one of the grouped layouts "
                                 f"{', '.join(f'{c} x [{o}]' for c, o in QKV_LAYOUTS)}")


def output_gated(attention, probe, heads: int | None = None) -> bool:
    """Whether the attention's output is o_proj(attention * sigmoid(gate)), the gate the second half of each head's
    q_proj rows: with the gate rows zero, the output is half the ungated one; with them a large multiple of one
    direction u, a token's output is the whole (x.u > 0) or nothing (x.u < 0)."""
    import torch

    heads, head_dim = heads or probe.heads, probe.head_dim
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(1, 6, probe.hidden, generator=gen)
    u = torch.randn(probe.hidden, generator=gen)
    rows = torch.arange(2 * heads * head_dim).view(heads, 2, head_dim)[:, 1].reshape(-1)      # each head's gate rows
    q_proj, o_proj = attention.q_proj, attention.o_proj
    rotary = getattr(probe.base, "rotary_emb", None)
    if rotary is None:
        return False                    # no rotary table to call the attention with: not this form
    cos, sin = rotary(x, torch.arange(6)[None])
    saved = q_proj.weight.detach().clone()
    outputs = []
    try:
        for gate_rows in (torch.zeros(len(rows), probe.hidden), (u * 1e4).expand(len(rows), -1)):
            with torch.no_grad():
                q_proj.weight[rows] = gate_rows
                out = attention(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None)
            out = out[0] if isinstance(out, tuple) else out
            outputs.append(out - (o_proj.bias if o_proj.bias is not None else 0))
    except Exception:  # noqa: BLE001 - not callable as transformers' usual attention: not this form
        return False
    finally:
        with torch.no_grad():
            q_proj.weight.copy_(saved)
    half, switched = outputs
    on = ((x[0] @ u) > 0)[:, None]
    return bool(half[0].abs().max() > 0) and torch.allclose(switched[0], torch.where(on, 2 * half[0], 0.0),
                                                            rtol=1e-4, atol=1e-5)


def value_norm(norm, head_dim: int, config) -> bool:
    """Whether the values are RMS-normalised per head without a weight before the cache (gemma4's v_norm), read
    numerically at the config's rms_norm_eps (the file's); NotNative for a v_norm that computes anything else."""
    import torch

    if norm is None:
        return False
    eps = getattr(config, "rms_norm_eps", None)
    x = torch.randn(2, 3, head_dim, generator=torch.Generator().manual_seed(5))
    if any(True for _ in norm.parameters()) or not isinstance(eps, float):
        raise NotNative("attention", f"v_norm {type(norm).__name__} has a weight, or the config no rms_norm_eps: "
                                     "not the weightless value norm the file writes")
    with torch.no_grad():
        got = norm(x)
    if not torch.allclose(got, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps), rtol=1e-4, atol=1e-5):
        raise NotNative("attention", f"v_norm {type(norm).__name__} is not an RMSNorm without a weight")
    return True


def qk_norm_width(modules: dict, heads: int, kv_heads: int, head_dim: int, names=QK_NORM_NAMES[0]) -> str:
    """"head": q / k norms per head (qwen3); "full": over all heads' width before the heads split (olmo2)."""
    widths = tuple(getattr(getattr(modules[n], "weight", None), "shape", (None,))[-1] for n in names)
    if widths == (head_dim, head_dim):
        return "head"
    if not any(True for n in names for _ in modules[n].parameters()):
        return "head"                   # without weights (nanochat's): per head, as the self-check holds it
    if widths == (heads * head_dim, kv_heads * head_dim):
        return "full"
    raise NotNative("attention", f"q/k norms of widths {widths}: neither per head ({head_dim}) nor over all heads")


def qk_norm_after_rope(probe, q_norm: str) -> bool:
    """Whether the first attention layer's q norm takes the queries after the rotary (hunyuan) rather than as
    projected (qwen3): the values it takes are all the projection's, in any layout, or rotated (positions past 0
    rotate)."""
    import torch

    attention = probe.layers[attention_layers(probe)[0]].self_attn
    projection = getattr(attention, "q_proj", None) or getattr(attention, "qkv_proj")
    seen = {}
    hooks = [projection.register_forward_hook(lambda m, args, out: seen.setdefault("projected", out)),
             getattr(attention, q_norm).register_forward_hook(lambda m, args, out: seen.setdefault("normed", args[0]))]
    try:
        with torch.no_grad():
            probe.model(input_ids=torch.tensor([[3, 5, 7, 11]]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    if "projected" not in seen or "normed" not in seen:
        raise NotNative("attention", f"{type(attention).__name__}'s q norm does not take the q projection's heads")
    return not bool(torch.isin(seen["normed"], seen["projected"]).all())


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


def _sink_kinds(probe, with_sinks: set) -> tuple | None:
    kinds = getattr(probe.config, "layer_types", None)
    if not isinstance(kinds, list) or len(kinds) < len(probe.layers):
        return None
    held = {kinds[index] for index in with_sinks}
    without = {kinds[index] for index in attention_layers(probe) if index not in with_sinks}
    return tuple(sorted(held)) if not held & without else None


def sink_layer_kinds(probe, with_sinks: set) -> tuple:
    """The config.layer_types kinds whose layers alone have sinks (mimo_v2_flash's MiMoV2FlashAttention: its
    sliding_attention layers), where the layers with sinks are exactly those kinds' and follow them on a config
    with two kinds swapped (not the layer index; the self-check runs that variant where the key/value heads follow
    the kinds too); NotNative for another pattern."""
    import torch

    rule = _sink_kinds(probe, with_sinks)
    kinds = getattr(probe.config, "layer_types", None)
    follows = False
    if rule and len(set(kinds[:len(probe.layers)])) == 2:
        first, second = sorted(set(kinds[:len(probe.layers)]))
        swapped = [second if kind == first else first if kind == second else kind for kind in kinds]
        try:
            other = probe.variant({"layer_types": swapped})
            moved = {index for index in attention_layers(other)
                     if isinstance(getattr(other.layers[index].self_attn, "sinks", None), torch.nn.Parameter)}
            follows = _sink_kinds(other, moved) == rule
        except Exception:  # noqa: BLE001 - a config the architecture refuses: the rule not confirmed
            follows = False
    if not follows:
        raise NotNative("attention", f"attention sinks on layers {sorted(with_sinks)} alone: not the layers of "
                                     "config.layer_types' kinds")
    return rule


def _softcapped(probe) -> bool:
    return getattr(probe.config, "attn_logit_softcapping", None) is not None


def _dense_match(part, probe, chosen, **extra) -> Match:
    position = chosen.get("position")
    if bool(position is not None and position.options.get("ALIBI")) != (part is ALIBI_PAGED):
        raise NotNative("attention", "ALiBi positions: the attention adds their bias (alibi_paged) or is not this "
                                     "model's")
    facts = dense_attention(probe)
    if facts.get("HEADS_PER_LAYER") and part is not FUSED_PAGED:
        raise NotNative("attention", f"query heads per layer (config.{facts['HEADS_PER_LAYER']}) with {part.name}: "
                                     "only the fused attention builds each layer with its own heads")
    if facts.get("V_NORM") and part is not FUSED_PAGED:
        raise NotNative("attention", f"a value norm with {part.name}: only the fused attention writes it")
    for option, what in (("KV_HEADS_PER_LAYER", "key/value heads per layer"), ("K_EQ_V", "keys as values"),
                         ("WINDOW_DECODE_ONLY", "a window at decode alone")):
        if facts.get(option) and part is not FUSED_PAGED:
            raise NotNative("attention", f"{what} with {part.name}: only the fused attention writes it")
    if facts.get("HEAD_DIM_PER_LAYER") and part is not FUSED_PAGED:
        raise NotNative("attention", f"head_dim per layer with {part.name}: only the fused attention builds each "
                                     "layer with its own head width")
    if facts.get("KEY_SCALE") and part not in (FUSED_PAGED, FUSED_PAGED_SINKS):
        raise NotNative("attention", f"keys times config.{facts['KEY_SCALE']} with {part.name}: only the fused "
                                     "attention writes it")
    if facts.get("QUERY_POSITION_SCALE") and part not in (FUSED_PAGED, FUSED_PAGED_SINKS):
        raise NotNative("attention", f"the llama-4 query scaling with {part.name}: only the fused attention writes it")
    if facts.get("QUERY_TEMPERATURE") and not (position is not None and position.options.get("NOPE_LAYERS")):
        raise NotNative("attention", "llama4's query temperature without a NoPE layers' rule (parts/rotary_nope.py): "
                                     "the file scales the NoPE layers' queries")
    if facts.get("QUERY_SSMAX") and facts.get("QK_NORM_AFTER_ROPE"):
        raise NotNative("attention", "beam's NoPE query scale with a query norm after the rotary: the scale is read "
                                     "after the norm, which the file would apply after it")
    if facts.get("QUERY_SSMAX") and not (position is not None and position.options.get("NOPE_LAYERS") == "typed_rope"):
        raise NotNative("attention", "beam's NoPE query scale without its NoPE layers' rule (rope_parameters' None "
                                     "kinds, parts/rotary_nope.py): the file scales those layers' queries")
    for option, what in (("QUERY_TEMPERATURE", "llama4's query temperature"), ("CHUNKED", "chunked local attention"),
                         ("QUERY_SSMAX", "beam's NoPE query scale")):
        if facts.get(option) and part not in (FUSED_PAGED, FUSED_PAGED_SINKS):
            raise NotNative("attention", f"{what} with {part.name}: only the fused attention writes it")
    options = {k: v for k, v in facts.items() if k in DENSE_OPTIONS}
    if position is not None and (position.options.get("ABSOLUTE_POSITIONS") or position.options.get("NO_POSITIONS")):
        extra = {**extra, "ROTARY": False}          # positions added to the embedding, or none: no rotary here
    return Match(part, options={**options, **extra},
                 facts={**facts, "partial": bool(position is not None and position.facts.get("partial"))})


def context_parallel(probe) -> bool:
    """CONTEXT_PARALLEL: the fused attention of a dense model splits a prefill over parallel_config.cp_size ranks
    (code/context_parallel.py). A model with sparse-MoE layers (and so an MTP draft) keeps it off: its expert
    routing over CP segments is not held per step, so preflight refuses cp_size for its file."""
    from agent.recipe.native.preflight import is_moe

    return not is_moe(probe.full_config.to_dict())


def _fused_paged(probe, chosen):
    if is_mla_model(probe) or _softcapped(probe) or dense_attention(probe)["sinks"]:
        return None
    return _dense_match(FUSED_PAGED, probe, chosen,
                        CONTEXT_PARALLEL=context_parallel(probe) and not dense_attention(probe).get("V_HEAD_DIM")
                        and not dense_attention(probe).get("CHUNKED"))


def _fused_paged_sinks(probe, chosen):
    if is_mla_model(probe) or _softcapped(probe) or not dense_attention(probe)["sinks"]:
        return None
    # a prefill split over CP ranks gathers keys and values of head_dim: not with narrower values
    return _dense_match(FUSED_PAGED_SINKS, probe, chosen, SINKS=True,
                        CONTEXT_PARALLEL=context_parallel(probe) and not dense_attention(probe).get("V_HEAD_DIM")
                        and not dense_attention(probe).get("CHUNKED"))


def _softcap_paged(probe, chosen):
    if is_mla_model(probe) or not _softcapped(probe):
        return None
    if dense_attention(probe)["sinks"]:
        raise NotNative("attention", "attention sinks with soft-capped logits: neither the fused attention nor the "
                                     "plain-torch one computes both")
    return _dense_match(SOFTCAP_PAGED, probe, chosen)


def alibi_scale(attention) -> float | None:
    """The softmax scale of an ALiBi model's attention: mpt's softmax_scale, bloom's inv_norm_factor."""
    for name in ("softmax_scale", "inv_norm_factor"):
        if isinstance(getattr(attention, name, None), float):
            return getattr(attention, name)
    return None


def _alibi_paged(probe, chosen):
    position = chosen.get("position")
    if position is None or not position.options.get("ALIBI"):
        return None
    if getattr(getattr(probe.config, "attn_config", None), "clip_qkv", None):
        raise NotNative("attention", "attn_config.clip_qkv: q/k/v clamped after the projection, which the file does "
                                     "not do")
    if is_mla_model(probe) or _softcapped(probe) or dense_attention(probe)["sinks"]:
        raise NotNative("attention", "ALiBi with latent attention, soft-capped logits or sinks: not written")
    if dense_attention(probe)["WINDOWS"]:
        raise NotNative("attention", "ALiBi with sliding-window layers: not written")
    return _dense_match(ALIBI_PAGED, probe, chosen, ROTARY=False)


WRITE_KERNELS = ("npu_scatter_nd_update_ (paged KV write)",)


def _rope_kernel(match) -> str:
    return "npu_apply_rotary_pos_emb (TND, rotate-half" + (", on the rotary slice)" if match.facts["partial"] else ")")


def _fused_kernels(match):
    window = ("; sliding-window layers: band mode (sparse_mode 4) at prefill and, on the window's blocks alone, at "
              "decode" if match.options["WINDOWS"] else "")
    sinks = "; attention sinks as its learnable_sink" if match.options.get("SINKS") else ""
    rope = (_rope_kernel(match),) if match.options.get("ROTARY", True) else ()
    gate = (gate_kernel(match.options),) if match.options.get("GATE_PROJ") else ()
    if match.options.get("QUERY_POSITION_SCALE"):
        gate += ("llama-4 query scaling: the rotated queries times 1 + llama_4_scaling_beta log(1 + floor(position / "
                 "original_max_position_embeddings)), from the rotary's positions, plain torch (no fused kernel "
                 "takes a per-token query scale)",)
    if match.options.get("QUERY_TEMPERATURE"):
        gate += ("llama4's attention temperature: the NoPE layers' queries times 1 + attn_scale log(1 + floor((position "
                 "+ 1) / floor_scale)), plain torch (no fused kernel takes a per-token query scale)",)
    if match.options.get("QUERY_SSMAX"):
        gate += ("beam's NoPE query scale: the NoPE layers' normed queries times (1 + (position + 1) / 2048) ** 0.1 in "
                 "float32, plain torch (no fused kernel takes a per-token query scale)",)
    if match.options.get("CHUNKED"):
        window += ("; chunked_attention layers: each prompt cut at its chunk boundaries at prefill (causal pieces), "
                   "the chunk's blocks alone at decode")
    if match.options.get("QK_L2_NORM"):
        rope += ("npu_rms_norm on a weight of ones: llama4's q/k norm of the rotated queries and keys, per head",)
    if match.options.get("ATTN_SUB_NORM"):
        gate += ("attention sub-norm before o_proj: RMSNorm over all heads' width in plain torch (its sum of squares "
                 "all-reduced over the attention's tensor-parallel ranks; npu_rms_norm norms one rank's slice)",)
    return (WRITE_KERNELS + rope + (f"npu_fused_infer_attention_score_v2 (TND, paged cache through "
                                    f"block_table{window}{sinks})",), gate)


def _softcap_kernels(match):
    window = "window's blocks on sliding-window layers and " if match.options["WINDOWS"] else ""
    return (WRITE_KERNELS + (_rope_kernel(match),),
            ("attention: plain torch over the paged cache (logit soft-capping: npu_fused_infer_attention_score has "
             f"no soft-cap); a decode step gathers the {window}the block table's width on full-attention layers "
             "(one shape for graph mode)",))


def _alibi_kernels(match):
    return (WRITE_KERNELS + ("npu_fused_infer_attention_score_v2 at decode (BSH, paged cache through block_table, the "
                             "ALiBi bias as its pse_shift)",),
            ("prefill attention: plain torch, one sequence at a time (ALiBi: the fused op's TND layout takes no "
             "pse_shift)",))


def _variants(match, probe):
    """The file serves the family's switches: a bias key toggled, a sliding window on (or off)."""
    found = []
    for option in ("QKV_BIAS", "O_BIAS"):
        value = match.options[option]
        if isinstance(value, Expr) and value.code.startswith("config."):      # not the last layer's (attention_params)
            key = value.code.split(".", 1)[1]
            change = ("bias " + key, {key: not getattr(probe.config, key)})
            if change not in found:
                found.append(change)
    if "heads_variant" in match.facts:
        found.append(("query heads per layer varied", match.facts["heads_variant"]))
    if "kv_heads_variant" in match.facts:
        found.append(("layer kinds swapped (key/value heads per kind)", match.facts["kv_heads_variant"]))
    if match.options.get("QUERY_POSITION_SCALE"):
        # the scaling steps at multiples of the original context: one the self-check's prompts reach
        found.append((f"query scaling original_max_position_embeddings {SMALL_ORIGINAL}",
                      small_original_setting(probe.config)))
    if match.options.get("QK_L2_NORM"):
        found.append((f"{QK_L2_KEY} off", {QK_L2_KEY: False}))      # llama4's 128E checkpoint: no q/k norm
    if match.options.get("K_EQ_V"):
        key = match.options["K_EQ_V"][0]
        found.append((f"{key} off", {key: False}))          # every layer its own v_proj (and key heads)
    if match.options.get("QUERY_TEMPERATURE"):
        # the scale steps at multiples of floor_scale: one the self-check's prompts reach
        found.append((f"query temperature floor_scale {SMALL_FLOOR}", small_floor_setting(probe.config)))
    if match.options.get("CHUNKED"):
        found.append((f"attention_chunk_size {SMALL_CHUNK}", small_chunk_setting(probe.config)))
    if "toggle" in match.facts:
        found.append(("sliding window " + ("off" if getattr(probe.config, "sliding_window", None) else "on"),
                      match.facts["toggle"]))
    return found


_READS = ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "attention_bias", "sliding_window",
          "layer_types", "query_pre_attn_scalar", "rms_norm_eps")
FUSED_PAGED = Part(
    slot="attention", name="fused_paged", code="attention_fused.py", provides="ModelAttention", reads=_READS,
    probe=_fused_paged, kernels=_fused_kernels, options=DENSE_OPTIONS + ("CONTEXT_PARALLEL",), variants=_variants)
FUSED_PAGED_SINKS = Part(
    slot="attention", name="fused_paged_sinks", code="attention_fused.py", provides="ModelAttention", reads=_READS,
    probe=_fused_paged_sinks, kernels=_fused_kernels, options=DENSE_OPTIONS + ("SINKS", "CONTEXT_PARALLEL"),
    variants=_variants)
SOFTCAP_PAGED = Part(
    slot="attention", name="softcap_paged", code="attention_softcap.py", provides="ModelSoftcapAttention",
    reads=_READS + ("attn_logit_softcapping",), probe=_softcap_paged, kernels=_softcap_kernels,
    options=DENSE_OPTIONS, variants=_variants)
ALIBI_PAGED = Part(
    slot="attention", name="alibi_paged", code="attention_alibi.py", provides="ModelAlibiAttention",
    reads=_READS, probe=_alibi_paged, kernels=_alibi_kernels, options=DENSE_OPTIONS, variants=_variants)
