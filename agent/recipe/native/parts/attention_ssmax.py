"""beam's query scale on its NoPE layers (scalable softmax, QUERY_SSMAX of the fused attention): each token's query,
after its q norm, times (1 + (position + 1) / 2048) ** 0.1 in float32 (parts/code/attention_ssmax.py). The model
computes it from the positions and hands it to the layers without rope settings (rope_parameters' None kinds); no
config key holds its constants. At the self-check's positions (under 20) the scale is about 1.001, which its
tolerance barely sees: read numerically at far positions instead. The whole model at positions far past 2048 (every
rotary table the near positions', so that only what else follows the positions differs) must be the model at
positions 0..3 with each NoPE layer's normed queries times the formula's ratio of far to near, and must differ from
it without that ratio; another position dependence is refused."""

from __future__ import annotations

from agent.recipe.native.not_native import NotNative

FAR = (3000, 100000)        # the far positions' starts: a wrong constant misses at one of them at least
TOKENS = 4


def _query_module(attention):
    """The module whose output is the query the scale multiplies: the q norm where there is one, else q_proj."""
    for name in ("q_norm", "q_proj"):
        if getattr(attention, name, None) is not None:
            return getattr(attention, name)
    return None


def _logits(probe, start: int, tables: list, scaled: dict):
    """The model's logits at positions start..start + TOKENS - 1; `tables`: the rotary embedding's outputs, recorded
    (empty) or replayed in call order; `scaled`: {layer index: per-token factor} on that layer's queries."""
    import torch

    ids = (torch.arange(TOKENS) * 5 + 2)[None] % probe.config.vocab_size
    replay, calls = bool(tables), iter(range(10 ** 6))

    def table_hook(module, args, output):
        if not replay:
            tables.append(output)
            return output
        return tables[next(calls)]

    hooks = [probe.base.rotary_emb.register_forward_hook(table_hook)]
    for index, factor in scaled.items():
        module = _query_module(probe.layers[index].self_attn)
        hooks.append(module.register_forward_hook(
            lambda m, args, out, f=factor: out * f.view(1, -1, *([1] * (out.dim() - 2))).to(out.dtype)))
    try:
        with torch.no_grad():
            return probe.model(input_ids=ids, position_ids=torch.arange(start, start + TOKENS)[None],
                               use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()


def _close(got, want) -> bool:
    return bool((got - want).abs().max() <= 1e-5 * want.abs().max())


def ssmax_query_scale(probe) -> bool:
    """QUERY_SSMAX: whether the NoPE layers of a model whose rope_parameters gives some attending kind None (beam's
    full-attention layers) scale their queries by parts/code/attention_ssmax.py's ssmax_scale (memoised); False for
    another model or where nothing follows the positions beyond the rotary tables; NotNative for another dependence."""
    if "ssmax" in probe.memo:
        return probe.memo["ssmax"]
    import torch

    from agent.recipe.native.parts.code.attention_ssmax import ssmax_scale
    from agent.recipe.native.parts.rotary_nope import rotating_layers, untyped_nope_tables

    found = False
    x = torch.zeros(1, 1, probe.hidden)
    try:
        untyped = untyped_nope_tables(probe, x) is not None
    except Exception:  # noqa: BLE001 - another rotary call: not this model
        untyped = False
    rotating = rotating_layers(probe) if untyped else None
    if rotating is not None and False in rotating:
        nope = [index for index, rotates in enumerate(rotating) if rotates is False]
        if any(_query_module(probe.layers[index].self_attn) is None for index in nope):
            raise NotNative("attention", "a NoPE layer's attention without q_proj: its query scale not read")
        near = torch.arange(TOKENS)
        try:
            tables: list = []
            base = _logits(probe, 0, tables, {})
            readings = []
            for start in FAR:
                ratio = ssmax_scale(near + start) / ssmax_scale(near)
                far = _logits(probe, start, tables, {})
                readings.append((_close(far, base), _close(far, _logits(probe, 0, tables, {i: ratio for i in nope}))))
        except Exception as exc:  # noqa: BLE001 - another call shape: not read here
            raise NotNative("attention", f"the NoPE layers' positions not read ({type(exc).__name__})") from exc
        if all(unchanged for unchanged, _ in readings):
            found = False
        elif all(scaled and not unchanged for unchanged, scaled in readings):
            found = True
        else:
            raise NotNative("attention", "the model's output follows the positions beyond its rotary tables, not as "
                                         "the NoPE layers' query scale (1 + (position + 1) / 2048) ** 0.1 the file "
                                         "writes")
    probe.memo["ssmax"] = found
    return found
