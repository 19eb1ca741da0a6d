"""Rotary with a rope base per layer (granite_swa: config.layer_rope_theta, 0 for a layer without rotary): the base
model holds one rotary table per distinct base (a list of weightless modules beside its layers); the config key is
found as the per-layer list whose non-zero values are those tables' bases, checked on their frequencies. The file
reads the list at run time (code: parts/code/causal_lm.py ROPE_BY_LAYER_THETA, one table per base;
parts/code/attention_fused.py, each layer's table and NOPE_LAYERS "layer_rope_theta" for a base of 0)."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative
from agent.recipe.native.parts.layout import weightless_lists
from agent.recipe.native.parts.mla import is_mla_model
from agent.recipe.native.parts.part import Match, Part
from agent.recipe.native.parts.position import ROTARY, TYPED_OPTIONS, probe_rotate_half, rope_match


def table_bases(tables) -> list[float] | None:
    """The rope base of each rotary table (its default-rope frequencies read back: inv_freq[1] = base ** (-2 / dim));
    None where a table is not a default rotary of one base."""
    import torch

    bases = []
    for table in tables:
        inv_freq = getattr(table, "inv_freq", None)
        if not isinstance(inv_freq, torch.Tensor) or inv_freq.numel() < 2:
            return None
        dim = 2 * inv_freq.numel()
        base = float(inv_freq[1].double() ** (-dim / 2.0))
        want = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        if not torch.allclose(inv_freq.double(), want, rtol=1e-4):
            return None
        bases.append(base)
    return bases


def per_layer_key(config, bases: list[float]) -> str | None:
    """The config key of a per-layer list of numbers whose distinct non-zero values are `bases`."""
    layers = config.num_hidden_layers
    for key, value in sorted(vars(config).items()):
        if not (isinstance(value, (list, tuple)) and len(value) >= layers and value
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            continue
        found = sorted({float(v) for v in value[:layers] if v})
        if len(found) == len(bases) and all(abs(a - b) <= 1e-3 * b for a, b in zip(found, sorted(bases))):
            return key
    return None


def _probe(probe, chosen):
    if is_mla_model(probe) or probe.base is None or not probe.layers:
        return None
    lists = weightless_lists(probe.base)
    if not lists:
        return None
    if len(lists) > 1:
        raise NotNative("position", f"several lists of rotary tables in the base model: {sorted(lists)}")
    name = next(iter(lists))
    bases = table_bases(getattr(probe.base, name))
    if bases is None:
        raise NotNative("position", f"{name}: not default-rope tables of one base each")
    key = per_layer_key(probe.config, bases)
    if key is None:
        raise NotNative("position", f"{name}: rope bases {bases} that no per-layer config list names")
    if key != "layer_rope_theta":
        # the code's NoPE rule reads layer_rope_theta by name (parts/code/attention_fused.py layer_uses_rope)
        raise NotNative("position", f"per-layer rope bases in config.{key}: the file reads them as layer_rope_theta")
    probe_rotate_half(probe.modeling)
    return rope_match(probe, ROTARY_LAYER_THETA, {"ROPE_BY_LAYER_THETA": key, "NOPE_LAYERS": key})


def _variants(match: Match, probe):
    """The rope types (the plain rotary part's), each layer's base read from the config: the full-attention layers
    on another base than the sliding ones, and a layer without rotary (base 0)."""
    key = match.options["ROPE_BY_LAYER_THETA"]
    found = ROTARY.variants(match, probe)
    count = probe.config_dict.get("num_hidden_layers") or probe.config.num_hidden_layers
    theta = float(probe.config.rope_parameters.get("rope_theta", 10000.0))
    kinds = probe.config_dict.get("layer_types") or list(probe.config.layer_types)
    by_kind = [theta * 100 if kind == "full_attention" else theta for kind in kinds[:count]]
    if len(set(by_kind)) == 1:                   # one layer kind: alternate the bases instead
        by_kind = [theta * (100 if i % 2 else 1) for i in range(count)]
    found.append(("layer bases: full and sliding layers apart", {key: by_kind}))
    found.append(("layer bases: layer 1 without rotary (base 0)", {key: [0 if i == 1 else v for i, v in enumerate(by_kind)]}))
    return found


ROTARY_LAYER_THETA = Part(
    slot="position", name="rotary_layer_theta", code="rotary.py", provides="ModelRotaryEmbedding",
    reads=ROTARY.reads + ("layer_rope_theta",), probe=_probe,
    options=("ROPE_BY_LAYER_TYPE", "ROPE_BY_LAYER_THETA", "NOPE_LAYERS") + TYPED_OPTIONS, variants=_variants,
    kernels=lambda m: ((), ()))
