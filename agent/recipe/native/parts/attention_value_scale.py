"""A constant multiplier of the attention's values (mimo_v2_flash's config.attention_value_scale: MiMoV2FlashAttention
scales v_proj's output by it before the attention). Read numerically, not from the attribute: on a config with the
key halved and the same weights, the first attention layer's output (o_proj unbiased, linear in the values) halves.
The fused attention part writes it as the option VALUE_SCALE (the key), the file reading the key at run time (None:
1, as the architecture's code)."""

from __future__ import annotations

VALUE_SCALE_KEYS = ("attention_value_scale",)


def _first_attention_output(probe, state: dict):
    import torch

    model = probe.model
    if state is not None:
        model.load_state_dict(state)
    seen = {}

    def keep(module, args, out) -> None:          # returns None: the output stays the module's
        seen.setdefault("out", (out[0] if isinstance(out, tuple) else out).detach())

    first = next(layer for layer in probe.layers if hasattr(layer, "self_attn"))    # a hybrid's attention layer
    hook = first.self_attn.register_forward_hook(keep)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 5, 7, 11]]) % probe.config.vocab_size, use_cache=False)
    finally:
        hook.remove()
    return seen.get("out")


def value_scale(probe) -> str | None:
    """The config key scaling the attention's values, or None where no key of VALUE_SCALE_KEYS does. Memoised."""
    if "value_scale" in probe.memo:
        return probe.memo["value_scale"]
    import torch

    found = None
    for key in VALUE_SCALE_KEYS:
        value = getattr(probe.config, key, None)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value:
            continue
        try:
            other = probe.variant({key: value / 2})
            base = _first_attention_output(probe, None)
            halved = _first_attention_output(other, probe.model.state_dict())
        except Exception:  # noqa: BLE001 - a config the architecture refuses: the key not confirmed
            continue
        if base is not None and halved is not None and base.abs().max() > 0 and \
                torch.allclose(halved, base / 2, rtol=1e-4, atol=1e-6):
            found = key
            break
    probe.memo["value_scale"] = found
    return found
