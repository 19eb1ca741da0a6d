"""A constant multiplier of the attention's keys (falcon_h1's config.key_multiplier: FalconH1Attention scales
k_proj's output by it before the rotary): q . k, and so the softmax scale, times it. Read numerically, not from the
attribute: on a config with the key halved and the same weights, the first attention layer's output is the
original's with its softmax scale halved. The fused attention part writes it as the option KEY_SCALE (the key), the
file multiplying its softmax scale by the key's value at run time."""

from __future__ import annotations

from agent.recipe.native.parts.attention_value_scale import _first_attention_output

KEY_SCALE_KEYS = ("key_multiplier",)


def key_scale(probe) -> str | None:
    """The config key scaling the attention's keys, or None where no key of KEY_SCALE_KEYS does. Memoised."""
    if "key_scale" in probe.memo:
        return probe.memo["key_scale"]
    import torch

    found = None
    for key in KEY_SCALE_KEYS:
        value = getattr(probe.config, key, None)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value:
            continue
        first = next(layer for layer in probe.layers if hasattr(layer, "self_attn")).self_attn
        try:
            other = probe.variant({key: value / 2})
            halved = _first_attention_output(other, probe.model.state_dict())
            saved = first.scaling
            first.scaling = saved / 2
            try:
                base = _first_attention_output(probe, None)
            finally:
                first.scaling = saved
        except Exception:  # noqa: BLE001 - a config the architecture refuses: the key not confirmed
            continue
        if base is not None and halved is not None and base.abs().max() > 0 and \
                torch.allclose(halved, base, rtol=1e-4, atol=1e-6):
            found = key
            break
    probe.memo["key_scale"] = found
    return found
