"""Rotary on some layers only, NoPE on the others (smollm3: the config's no_rope_layers; exaone4, cohere2: the
full-attention layers of a config with a sliding window; cohere2_moe: those, but its dense-MLP layers rotate where
prefix_dense_sliding_window_pattern is 1), rotate-half or interleaved (parts/rotary_interleaved.py):
which layers rotate is read off transformers' attention numerically (its output with one rotary against another),
then matched to the config rule that gives the same layers, which the file reads at run time (code:
parts/code/attention_fused.py NOPE_LAYERS; cos / sin parts/code/rotary.py's)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.mla import is_mla_model
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.position import ROTARY, TYPED_OPTIONS, probe_rotate_half, rope_match
from agent.recipe.native.parts.rotary_interleaved import interleaved_form

# the config rules a layer's rotary follows: name -> (config, layer) -> whether the layer rotates
# (the same rules as parts/code/attention_fused.py's layer_uses_rope); the first that holds on the config and on
# its toggles (rule_toggles) is the architecture's
RULES = {
    "no_rope_layers": lambda config, i: bool(config.no_rope_layers[i]),
    # beam: rope_parameters keyed by layer type, None for a kind without positions
    "typed_rope": lambda config, i: isinstance(config.rope_parameters.get(config.layer_types[i]), dict),
    # cohere2_moe: its sliding layers, and its dense-MLP layers where prefix_dense_sliding_window_pattern is 1
    "sliding_or_dense_prefix": lambda config, i: (
        bool(getattr(config, "sliding_window", None)) and config.layer_types[i] == "sliding_attention"
        or config.mlp_layer_types[i] == "dense" and config.prefix_dense_sliding_window_pattern == 1),
    "global_nope": lambda config, i: (not getattr(config, "sliding_window", None)
                                      or config.layer_types[i] == "sliding_attention"),
}


def flipped_mlp_kinds(config) -> list | None:
    """The config's mlp_layer_types with dense and sparse swapped; None where it has none."""
    kinds = getattr(config, "mlp_layer_types", None)
    if not isinstance(kinds, (list, tuple)):
        return None
    return ["dense" if kind == "sparse" else "sparse" if kind == "dense" else kind for kind in kinds]


def rule_toggles(rule: str, config) -> list[dict]:
    """Config changes under which `rule` must still give transformers' rotating layers: where a config states
    each layer's MLP kind, the kinds turned over (a rule that ignores them must not be taken where they decide
    the rotary), and for the rule that reads prefix_dense_sliding_window_pattern, that key unequal to 1 too."""
    flipped = flipped_mlp_kinds(config)
    if rule == "typed_rope":
        swapped = swapped_rope_kinds(config)
        return [swapped] if swapped else []
    if flipped is None or rule == "no_rope_layers":
        return []
    toggles = [{"mlp_layer_types": flipped}]
    if rule == "sliding_or_dense_prefix":
        toggles.append({"mlp_layer_types": flipped, "prefix_dense_sliding_window_pattern": 2})
    return toggles


def swapped_rope_kinds(config) -> dict:
    """The config change that gives the rope settings of the one layer type with them to the one without (beam's
    sliding layers NoPE, its full-attention layers rotating); {} unless there are exactly those two kinds."""
    params = config.rope_parameters
    kinds = sorted(set(config.layer_types))
    typed = [kind for kind in kinds if isinstance(params.get(kind), dict)]
    if len(kinds) != 2 or len(typed) != 1:
        return {}
    (other,) = set(kinds) - set(typed)
    return {"rope_parameters": {**params, typed[0]: None, other: params[typed[0]]}}


def handed_no_table(probe) -> set:
    """The attention layers the model hands no rotary table (lara_mini: position_embeddings only to its
    sliding_attention layers), seen on one forward of the model; empty where it cannot run here."""
    import torch

    handed = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda module, args, kwargs, i=i: handed.__setitem__(i, kwargs.get("position_embeddings") is not None),
        with_kwargs=True) for i, layer in enumerate(probe.layers) if hasattr(layer, "self_attn")]
    try:
        with torch.no_grad():
            probe.model(input_ids=torch.arange(4)[None] % probe.config.vocab_size)
    except Exception:  # noqa: BLE001 - a model that does not run here: each layer's own attention decides
        return set()
    finally:
        for hook in hooks:
            hook.remove()
    return {i for i, given in handed.items() if not given}


def untyped_nope_tables(probe, x) -> dict | None:
    """{layer type: (cos, sin)} of the layer types with rope settings, where rope_parameters is keyed by layer type
    and gives some attending kind None (beam's full-attention layers); None otherwise (the model's one table)."""
    import torch

    from agent.recipe.native.parts.position import typed_layer_types

    config = probe.config
    params = getattr(config, "rope_parameters", None)
    kinds = set(getattr(config, "layer_types", None) or [])
    if not isinstance(params, dict) or not any(kind in params and params[kind] is None for kind in kinds):
        return None
    return {kind: probe.base.rotary_emb(x, torch.arange(4)[None], layer_type=kind)
            for kind in typed_layer_types(config)}


def rotating_layers(probe) -> tuple[bool, ...] | None:
    """Per layer: whether transformers' attention output depends on the rotary it is given, and the model gives it
    one; None where the attention or the rotary embedding is not callable as transformers' usual ones (not this
    part's to read). A hybrid's linear-attention layers (no self_attn) are left out."""
    import torch

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, 4, probe.hidden, generator=gen)
    found = []
    try:
        by_kind = untyped_nope_tables(probe, x)
        if by_kind is None:
            # cos / sin as wide as the attention takes them (the rotary embedding's own width, partial or not)
            table = probe.base.rotary_emb(x, torch.arange(4)[None])
            if isinstance(table, torch.Tensor) and table.is_complex():
                # llama4's one complex table e^(i a): no rotation is 1
                tables = (table, torch.ones_like(table))
            else:
                cos, sin = table
                tables = ((cos, sin), (torch.ones_like(cos), torch.zeros_like(sin)))
        untabled = handed_no_table(probe) if by_kind is not None or any(
            not hasattr(layer, "self_attn") for layer in probe.layers) else set()
        for index, layer in enumerate(probe.layers):
            if not hasattr(layer, "self_attn"):
                found.append(None)
                continue
            if index in untabled:
                found.append(False)
                continue
            if by_kind is not None:
                # a layer of a kind with no rope settings that the model hands a table: not read here
                cos, sin = by_kind[probe.config.layer_types[index]]
                tables = ((cos, sin), (torch.ones_like(cos), torch.zeros_like(sin)))
            outputs = []
            for table in tables:
                with torch.no_grad():
                    out = layer.self_attn(hidden_states=x, position_embeddings=table, attention_mask=None)
                outputs.append(out[0] if isinstance(out, tuple) else out)
            found.append(not torch.allclose(outputs[0], outputs[1], rtol=1e-5, atol=1e-6))
    except Exception:  # noqa: BLE001 - no rotary_emb, per-layer-type tables, another call shape
        return None
    return tuple(found)


def _rule_holds(name: str, probe, rotating=None) -> bool:
    """Whether RULES[name] on the probe's config gives the layers transformers' attention rotates."""
    rotating = rotating_layers(probe) if rotating is None else rotating
    if rotating is None:
        return False
    attending = [i for i, r in enumerate(rotating) if r is not None]
    try:
        return [RULES[name](probe.config, i) for i in attending] == [rotating[i] for i in attending]
    except (AttributeError, IndexError, TypeError):
        return False


def _variant_holds(name: str, probe, changes: dict) -> bool:
    try:
        variant = probe.variant(changes)
    except NotNative:       # transformers cannot build the toggled config: the rule is not shown to hold
        return False
    return _rule_holds(name, variant)


def nope_rule(probe) -> str | None:
    """The config rule of the layers that rotate; None when every layer does."""
    rotating = rotating_layers(probe)
    if rotating is None or all(r is not False for r in rotating):
        return None
    for name in RULES:
        if _rule_holds(name, probe, rotating) and all(
                _variant_holds(name, probe, changes) for changes in rule_toggles(name, probe.config)):
            return name
    raise NotNative("position", f"layers {[i for i, r in enumerate(rotating) if r is False]} have no rotary (NoPE) "
                                f"by no config rule the file reads ({', '.join(RULES)})")


def _probe(probe, chosen):
    if is_mla_model(probe) or not probe.layers:
        return None
    rule = nope_rule(probe)
    if rule is None:
        return None
    options = {"NOPE_LAYERS": rule}
    try:
        probe_rotate_half(probe.modeling)
    except NotNative:
        if not interleaved_form(probe.modeling):
            raise
        options["ROPE_INTERLEAVED"] = True          # cohere2: interleaved on its sliding layers, NoPE on the others
    return rope_match(probe, ROTARY_NOPE, options)


def _variants(match: Match, probe):
    """The rope types (the plain rotary part's), and for no_rope_layers the pattern turned over: the file reads
    which layers rotate from each checkpoint's config."""
    found = ROTARY.variants(match, probe)
    if match.options["NOPE_LAYERS"] == "no_rope_layers":
        flipped = [0 if value else 1 for value in probe.config.no_rope_layers]
        found.append(("nope no_rope_layers", {"no_rope_layers": flipped}))
    if match.options["NOPE_LAYERS"] == "typed_rope" and swapped_rope_kinds(probe.config):
        # which kinds rotate is read from rope_parameters at run time: the kinds' settings swapped
        found.append(("nope rope_parameters swapped", swapped_rope_kinds(probe.config)))
    if match.options["NOPE_LAYERS"] == "sliding_or_dense_prefix":
        # the dense layers rotate by prefix_dense_sliding_window_pattern (the MoE part turns the MLP kinds over alone)
        found.append(("nope prefix_dense_sliding_window_pattern 2",
                      {"mlp_layer_types": flipped_mlp_kinds(probe.config), "prefix_dense_sliding_window_pattern": 2}))
    return found


ROTARY_NOPE = Part(
    slot="position", name="rotary_nope", code="rotary.py", provides="ModelRotaryEmbedding",
    reads=ROTARY.reads + ("no_rope_layers", "sliding_window", "mlp_layer_types", "prefix_dense_sliding_window_pattern"),
    probe=_probe,
    options=("ROPE_BY_LAYER_TYPE", "NOPE_LAYERS", "ROPE_INTERLEAVED") + TYPED_OPTIONS, variants=_variants,
    kernels=lambda m: ((), ()))
