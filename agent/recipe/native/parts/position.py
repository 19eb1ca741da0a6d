"""Rotary position embedding (code/rotary.py): rotate-half (npu_apply_rotary_pos_emb's formula, probed on the
architecture's apply_rotary_pos_emb), cos / sin of the config's rope type at run time — every type transformers'
ROPE_INIT_FUNCTIONS knows — per layer type where the architecture keeps rope settings per type (gemma3), partial
where the config says so."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.mla import is_mla_model
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.probe import DROP

# transformers' rope initialisations the file computes (default) or calls at run time (the rest; the checkout's
# transformers 5.0.0 knows each)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# rope types the file computes where a checkpoint has them, not offered as another checkpoint's setting: proportional
# (lfm3's full-attention layers; transformers 5.0.0 has no such type, the file computes it)
FILE_ONLY_ROPE_TYPES = ("proportional",)
# the self-check's lengths: the longest prompt 13 tokens, then 5 decode steps; a length-dependent rope's original
# context between the two (past it, the decode steps' frequencies change)
ORIGINAL_CONTEXT = 14


# the options rope_match may add for per-type rope (every part that calls it declares them)
TYPED_OPTIONS = ("ROPE_TYPED_LAYERS", "DEFAULT_WHOLE_HEAD", "PROPORTIONAL_ROPE")


def probe_rotate_half(modeling_module, backward_ok: bool = False) -> bool:
    """The architecture's apply_rotary_pos_emb is q*cos + rotate_half(q)*sin (npu_apply_rotary_pos_emb's
    formula); an interleaved or other rotary is not native. With `backward_ok`, True where it rotates by the
    negative angle (nanochat's rotate_half cat(x2, -x1): the sin table negated), else False."""
    import torch

    apply = getattr(modeling_module, "apply_rotary_pos_emb", None)
    if apply is None:
        raise NotNative("position", "no apply_rotary_pos_emb in the modeling code")
    gen = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 2, 3, 8, generator=gen)
    angles = torch.randn(1, 3, 4, generator=gen)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()

    def half(x, sign=1.0):
        x1, x2 = x[..., :4], x[..., 4:]
        return x * cos[:, None] + sign * torch.cat((-x2, x1), -1) * sin[:, None]

    def matches(c, s, sign=1.0):
        """The architecture's function given cos / sin as its rotary embedding makes them: full width
        (the angles twice) or half width (gpt_oss: the angles once, applied to each half); on q and k together,
        or on one tensor at a time (gemma4's apply_rotary_pos_emb(x, cos, sin))."""
        try:
            got_q, got_k = apply(q, k, c, s)[:2]
        except Exception:  # noqa: BLE001 - another signature or width: not this form
            try:
                got_q, got_k = apply(q, c, s), apply(k, c, s)
            except Exception:  # noqa: BLE001 - neither signature
                return False
            if not (isinstance(got_q, torch.Tensor) and isinstance(got_k, torch.Tensor)):
                return False
        return torch.allclose(got_q, half(q, sign), atol=1e-5) and torch.allclose(got_k, half(k, sign), atol=1e-5)
    if backward_ok and not matches(cos, sin) and matches(cos, sin, -1.0):
        return True
    if not (matches(cos, sin) or matches(angles.cos(), angles.sin())):
        raise NotNative("position", "rotary is not rotate-half (interleaved or other): npu_apply_rotary_pos_emb "
                                    "with rotary_mode half does not compute it")
    return False


def rope_groups(config) -> tuple[bool, list]:
    """(per layer type, the rope settings of each group): per type where rope_parameters holds settings under
    layer types' names (gemma3: every type's; lfm3: its attention types', none for its conv layers)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        raise NotNative("position", "no rope_parameters in the config")
    typed = typed_layer_types(config)
    return bool(typed), ([params[t] for t in typed] if typed else [params])


def typed_layer_types(config) -> list:
    """The layer types of config.layer_types that have rope settings of their own in rope_parameters, sorted."""
    params = getattr(config, "rope_parameters", None) or {}
    return sorted(t for t in set(getattr(config, "layer_types", None) or []) if isinstance(params.get(t), dict))


def typed_layers(probe, nope_untyped: bool = False) -> dict:
    """{"ROPE_TYPED_LAYERS": True} where only some layer types have rope settings (lfm3's conv layers none), after
    checking that every attention layer's type has them (`nope_untyped`: the position part read the others' layers
    as NoPE, beam's full-attention layers); {} where every type does."""
    config = probe.config
    typed = typed_layer_types(config)
    if set(typed) == set(config.layer_types):
        return {}
    for index, layer in enumerate([] if nope_untyped else probe.layers):
        if getattr(layer, "self_attn", None) is not None and config.layer_types[index] not in typed:
            raise NotNative("position", f"layer {index} ({config.layer_types[index]}) attends, and rope_parameters "
                                        f"holds settings for {', '.join(typed)} alone")
    return {"ROPE_TYPED_LAYERS": True}


def default_whole_head(probe) -> dict:
    """{"DEFAULT_WHOLE_HEAD": True} where the architecture's default rope rotates the whole head whatever
    partial_rotary_factor says (lfm3's own default), {} where it rotates that fraction; read off its table of a
    layer type set to the default rope at half the head. Asked only of per-type rope with a partial group (the file
    serves each rope type on that group's settings)."""
    import torch

    config = probe.config
    typed = typed_layer_types(config)
    kind = typed[0]
    params = {**config.rope_parameters, kind: {"rope_type": "default", "partial_rotary_factor": 0.5,
                                               "rope_theta": float(config.rope_parameters[kind].get("rope_theta",
                                                                                                    10000.0))}}
    try:
        rope = probe.variant({"rope_parameters": params})
        cos, _ = rope.base.rotary_emb(torch.zeros(1, 2, probe.hidden), torch.arange(2)[None], layer_type=kind)
    except Exception as exc:  # noqa: BLE001 - another rotary call: the file cannot read its width
        raise NotNative("position", f"rope per layer type with a partial rotary: the default rope's width not read "
                                    f"({type(exc).__name__})") from exc
    width = cos.shape[-1]
    # that layer type's head width where head_dim is set per layer (gemma4's full layers: parts/attention_head_dim.py)
    head_dim = config.per_layer_config[kind].head_dim if probe.layer_head_dims else probe.head_dim
    if width == head_dim:
        return {"DEFAULT_WHOLE_HEAD": True}
    if width == head_dim // 2:
        return {}
    raise NotNative("position", f"the default rope at partial_rotary_factor 0.5 rotates {width} of {head_dim} "
                                "dims")


def ntk_alpha(probe) -> dict:
    """{"NTK_ALPHA": True} where the rope settings hold a fixed NTK `alpha` (hunyuan: its checkpoints say
    "dynamic") and the model's frequencies are the default rope's on the base stretched by
    alpha ** (head_dim / (head_dim - 2)); {} without an alpha; NotNative for another use of it."""
    import torch

    params = getattr(probe.config, "rope_parameters", None)
    if not isinstance(params, dict) or not params.get("alpha"):
        return {}
    dim = probe.head_dim
    base = float(params["rope_theta"]) * float(params["alpha"]) ** (dim / (dim - 2))
    want = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    got = getattr(getattr(probe.base, "rotary_emb", None), "inv_freq", None)
    if got is None or tuple(got.shape) != tuple(want.shape) or not torch.allclose(got.float(), want, rtol=1e-5):
        raise NotNative("position", "rope_parameters' alpha: the frequencies are not the NTK-alpha stretched base's")
    return {"NTK_ALPHA": True}


def _probe(probe, chosen):
    if getattr(probe.config, "alibi", None) is True:
        return None                     # falcon's config.alibi: ALiBi instead of the rotary its model still builds
    kind = getattr(probe.config, "position_embedding_type", "rope")
    if kind not in ("rope", "rotary") and probe.base is not None and getattr(probe.base, "rotary_emb", None) is None \
            and not any(hasattr(layer, "self_attn") for layer in probe.layers):
        # NoPE attention is written (parts/position_none.py) where the model has it: here it has none
        raise NotNative("attention", "no attention layer: every layer a Mamba2 mixer and an MLP (granitemoehybrid's "
                                     "default layer_types), which no part writes (mamba2's layers of one mixer are)")
    if kind not in ("rope", "rotary") and probe.base is not None and getattr(probe.base, "rotary_emb", None) is None:
        # granitemoehybrid's default (None) or "nope": the model builds no rotary table
        raise NotNative("position", f"position_embedding_type {kind!r}: no rotary table, attention without positions "
                                    "(NoPE) on every layer, which no part writes")
    backward = False
    if not is_mla_model(probe):        # MLA rotates by its own kernels (interleave-half), probed with the attention
        backward = probe_rotate_half(probe.modeling, backward_ok=True)
    return rope_match(probe, ROTARY, {**ntk_alpha(probe), **({"ROTATE_BACKWARD": True} if backward else {})})


def rope_match(probe, part, options=None) -> Match:
    """`part`'s match for the config's rope settings (the rope types the file computes), `options` added."""
    from agent.recipe.native.parts.layout import weightless_lists

    tables = weightless_lists(probe.base) if probe.base is not None else set()
    if tables and not (options or {}).get("ROPE_BY_LAYER_THETA"):
        raise NotNative("position", f"rotary tables per layer ({', '.join(sorted(tables))}) read by no rule of "
                                    "this part")
    by_type, groups = rope_groups(probe.config)
    types = tuple(sorted({g.get("rope_type", "default") for g in groups}))
    for rope_type in types:
        if rope_type not in ROPE_TYPES + FILE_ONLY_ROPE_TYPES:
            raise NotNative("position", f"rope_type {rope_type!r}: the file computes "
                                        f"{', '.join(ROPE_TYPES + FILE_ONLY_ROPE_TYPES)}")
    partial = any(float(g.get("partial_rotary_factor", getattr(probe.config, "partial_rotary_factor", 1.0)) or 1.0)
                  < 1.0 for g in groups)
    if partial and is_mla_model(probe):
        # dots3_note's partial_rotary_factor is qk_rope_head_dim / head_dim (its rotary tables, one per layer type,
        # built on head_dim); the file's MLA table is qk_rope_head_dim x the factor wide
        factors = sorted({float(g.get("partial_rotary_factor", 1.0) or 1.0) for g in groups})
        raise NotNative("position", f"MLA with partial_rotary_factor {'/'.join(f'{f:g}' for f in factors)} in its "
                                    "rope settings (of head_dim, not of qk_rope_head_dim): the file's MLA rotary "
                                    "table is qk_rope_head_dim wide times the factor, no part reads it otherwise")
    found = {"ROPE_BY_LAYER_TYPE": by_type}
    if by_type:
        found.update(typed_layers(probe, (options or {}).get("NOPE_LAYERS") == "typed_rope"))
        if partial:
            found.update(default_whole_head(probe))
    if "proportional" in types:
        found["PROPORTIONAL_ROPE"] = True
    return Match(part, options={**found, **(options or {})},
                 facts={"rope_types": types, "partial": partial, "by_type": by_type})


def rope_variant(rope_type: str, params: dict, rotary_dim: int) -> tuple[dict, dict]:
    """(rope settings of `rope_type` keeping `params`' base, other config changes) for the self-check's lengths."""
    base = {k: v for k, v in params.items() if k in ("rope_theta", "partial_rotary_factor")}
    half = max(rotary_dim // 2, 1)
    table = {
        "default": ({}, {}),
        "linear": ({"factor": 2.0}, {}),
        "dynamic": ({"factor": 2.0}, {"max_position_embeddings": ORIGINAL_CONTEXT}),
        "yarn": ({"factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0}, {}),
        "longrope": ({"short_factor": [1.0 + 0.05 * i for i in range(half)],
                      "long_factor": [1.0 + 0.5 * i for i in range(half)],
                      "original_max_position_embeddings": ORIGINAL_CONTEXT},
                     {"max_position_embeddings": 4 * ORIGINAL_CONTEXT}),
        "llama3": ({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16}, {}),
    }
    extra, changes = table[rope_type]
    return {"rope_type": rope_type, **base, **extra}, changes


def _variants(match, probe):
    """The file serves every rope type of ROPE_INIT_FUNCTIONS: one variant per type the checkpoint does not use
    (on every layer type's settings alike)."""
    by_type, groups = rope_groups(probe.config)
    head_dim = probe.config.qk_rope_head_dim if getattr(probe.config, "kv_lora_rank", None) else probe.head_dim
    found = []
    for rope_type in ROPE_TYPES:
        if rope_type in match.facts["rope_types"]:
            continue
        params = dict(probe.config.rope_parameters)
        changes = {}
        for key, group in (params.items() if by_type else [(None, params)]):
            if by_type and not isinstance(group, dict):
                continue
            factor = float(group.get("partial_rotary_factor", getattr(probe.config, "partial_rotary_factor", 1.0)) or 1.0)
            if match.options.get("DEFAULT_WHOLE_HEAD") and rope_type != "default":
                # the architecture rotates whole heads only (lfm3's apply_rotary_pos_emb): no partial setting of
                # another rope type runs in transformers
                group, factor = {k: v for k, v in group.items() if k != "partial_rotary_factor"}, 1.0
            spec, changes = rope_variant(rope_type, group, int(head_dim * factor))
            if by_type:
                params[key] = spec
            else:
                params = spec
        if "rope_scaling" in probe.config_dict:
            changes = {**changes, "rope_scaling": DROP}     # a hub config.json's legacy copy of the rope settings
        found.append((f"rope {rope_type}", {"rope_parameters": params, **changes}))
    return found


ROTARY = Part(
    slot="position", name="rotary", code="rotary.py", provides="ModelRotaryEmbedding",
    reads=("rope_parameters", "partial_rotary_factor", "max_position_embeddings", "layer_types"),
    probe=_probe, options=("ROPE_BY_LAYER_TYPE", "NTK_ALPHA", "ROTATE_BACKWARD") + TYPED_OPTIONS, variants=_variants,
    kernels=lambda m: ((), ()))
