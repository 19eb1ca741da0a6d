"""llama4's attention temperature (config.attn_temperature_tuning): on the NoPE layers, each token's query times
1 + attn_scale log(1 + floor((position + 1) / floor_scale)) (parts/code/attention_temperature.py; the fused attention's
QUERY_TEMPERATURE: the file reads the three keys at run time). transformers' attention takes the positions from its
cache's length, not from an argument: read numerically on the first NoPE layer's attention called alone, once with no
cache (positions 0..3) and once with a cache that holds FAR tokens, at positions on both sides of a floor step: the
second must be the first with each token's q_proj output times the formula's ratio. The rotating layers must not
scale, and attn_temperature_tuning must switch it. The self-check's prompts end long before floor_scale (8192): the
attention part adds a family setting with a small one."""

from __future__ import annotations

import inspect

from agent.recipe.native.not_native import NotNative

TUNING_KEY = "attn_temperature_tuning"
FLOOR_KEY, SCALE_KEY = "floor_scale", "attn_scale"
STEPS = (1, 5)          # the far positions straddle the floor steps at these multiples of floor_scale
SMALL_FLOOR = 4         # the family setting's floor_scale: the scale steps within the self-check's prompts


class _PastTokens:
    """A cache that says it holds `seen` tokens and hands the new keys and values back as they are: the attention's
    positions start at `seen`, its keys are the new ones alone."""

    def __init__(self, seen: int):
        self.seen = seen

    def get_seq_length(self, layer_idx=0):
        return self.seen

    def update(self, key_states, value_states, *args, **kwargs):
        return key_states, value_states


def _output(attention, x, table, seen: int | None, hook=None):
    import torch

    params = inspect.signature(attention.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    given = {cache_arg: _PastTokens(seen)} if seen is not None else {}
    handle = attention.q_proj.register_forward_hook(hook) if hook is not None else None
    try:
        with torch.no_grad():
            out = attention(hidden_states=x, position_embeddings=table, attention_mask=None, **given)
    finally:
        if handle is not None:
            handle.remove()
    return out[0] if isinstance(out, tuple) else out


def _scales_like_formula(probe, index: int, floor_scale: float, attn_scale: float) -> bool | None:
    """Whether layer `index`'s attention at far positions is its output at 0..3 with each query times the formula's
    ratio (True), the same as there (False), or neither (None)."""
    import torch

    from agent.recipe.native.parts.code.attention_temperature import temperature_scale

    attention = probe.layers[index].self_attn
    if not isinstance(getattr(attention, "q_proj", None), torch.nn.Linear):
        return None
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(1, 4, probe.hidden, generator=gen)
    near = torch.arange(4)
    table = probe.base.rotary_emb(x, near[None])
    near_out = _output(attention, x, table, None)
    scaled = unchanged = True
    for step in STEPS:
        seen = int(step * floor_scale) - 2
        ratio = temperature_scale(near + seen, floor_scale, attn_scale) / temperature_scale(near, floor_scale, attn_scale)
        got = _output(attention, x, table, seen)
        want = _output(attention, x, table, None, hook=lambda m, args, out: out * ratio[None, :, None].to(out.dtype))
        scaled &= bool((got - want).abs().max() <= 1e-5 * want.abs().max())
        unchanged &= bool((got - near_out).abs().max() <= 1e-5 * near_out.abs().max())
    return True if scaled and not unchanged else False if unchanged else None


def query_temperature(probe) -> bool:
    """QUERY_TEMPERATURE: whether the NoPE layers scale their queries as llama4's attn_temperature_tuning, read on the
    config with the key on (memoised); False for a config without the key; NotNative where the key is set and the
    attention scales otherwise (or the rotating layers scale too, or the key does not switch it)."""
    if "query_temperature" in probe.memo:
        return probe.memo["query_temperature"]
    found = False
    config = probe.config
    if isinstance(getattr(config, TUNING_KEY, None), bool):
        from agent.recipe.native.parts.rotary_nope import rotating_layers

        on = probe if getattr(config, TUNING_KEY) else probe.variant({TUNING_KEY: True})
        rotating = rotating_layers(on)
        floor_scale, attn_scale = getattr(on.config, FLOOR_KEY, None), getattr(on.config, SCALE_KEY, None)
        if rotating is not None and False in rotating and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                              for v in (floor_scale, attn_scale)):
            nope, rope = rotating.index(False), rotating.index(True) if True in rotating else None
            try:
                readings = (_scales_like_formula(on, nope, floor_scale, attn_scale),
                            _scales_like_formula(on, rope, floor_scale, attn_scale) if rope is not None else False,
                            _scales_like_formula(on.variant({TUNING_KEY: False}), nope, floor_scale, attn_scale))
            except Exception as exc:  # noqa: BLE001 - another call shape: not the form read here
                raise NotNative("attention", f"{TUNING_KEY}: the NoPE layers' attention does not run alone with a "
                                             "cache") from exc
            if readings != (True, False, False):
                raise NotNative("attention", f"the NoPE layers' query temperature ({TUNING_KEY}) not as the file "
                                             f"writes it (1 + {SCALE_KEY} log(1 + floor((position + 1) / "
                                             f"{FLOOR_KEY})) on the NoPE layers alone, switched by the key)")
            found = True
    probe.memo["query_temperature"] = found
    return found


def small_floor_setting(config) -> dict:
    """The family setting that brings the temperature within the self-check's prompts: the key on, floor_scale
    SMALL_FLOOR."""
    return {TUNING_KEY: True, FLOOR_KEY: SMALL_FLOOR}
