"""How a model steps, asked of the model once (`probe_step`) instead of assumed.

What one step hands the next goes by the names transformers' generate() carries it under: a Cache
(`cache`; `past_key_values` in code older than transformers 5), or a model's own state returned by
each forward (generation.utils.DEPRECATED_CACHE_NAMES: rwkv `state`, xlnet `mems`, reformer's). The
rest is read from the model's `prepare_inputs_for_generation` (what generate() calls each step) on a
dummy sequence: whether a decode step gets the whole sequence (openai-gpt, cpmant), no attention mask
(mamba), or inputs the model builds itself (xlm appends its mask token and predicts there).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

CACHE_CLASS_NAMES = ("cache", "past_key_values")
CACHE_NAMES = (*CACHE_CLASS_NAMES, "state", "mems", "past_buckets_states")


@dataclass(frozen=True)
class StepTraits:
    cache_kwarg: str = "past_key_values"   # the forward's argument for what one step hands the next
    full_sequence: bool = False            # a decode step is fed the whole sequence, not the new token
    without_mask: bool = False             # a decode step gets no attention mask
    builds_own_step: bool = False          # its prepare_inputs_for_generation builds each step's inputs
    logits_to_keep: bool = False           # the forward can compute the last position's logits only

    @property
    def carries_a_cache(self) -> bool:
        """What one step hands the next is a transformers Cache (a StaticCache can stand in for it)."""
        return self.cache_kwarg in CACHE_CLASS_NAMES


def cache_argument(forward_params) -> str:
    """The forward's argument for the cache, as the model's own signature names it;
    `past_key_values` for a forward that names none (it may take it through **kwargs)."""
    return next((name for name in CACHE_NAMES if name in forward_params), "past_key_values")


def probe_step(model) -> StepTraits:
    params = set(inspect.signature(model.forward).parameters)
    return StepTraits(cache_kwarg=cache_argument(params), full_sequence=wants_full_sequence(model),
                      without_mask=decodes_without_mask(model), builds_own_step=builds_own_step(model),
                      logits_to_keep="logits_to_keep" in params)


def _prepared(model, ids, **kwargs) -> dict | None:
    """What the model's own generation step builds from `ids` (None: it has none, or it fails on
    this unusual call; then the engine's own step applies)."""
    import torch

    prepare = getattr(model, "prepare_inputs_for_generation", None)
    if prepare is None:
        return None
    try:
        inputs = prepare(ids, next_sequence_length=1, attention_mask=torch.ones_like(ids), use_cache=True, **kwargs)
    except Exception:  # noqa: BLE001 - an unusual signature: keep the engine's step
        return None
    return inputs if isinstance(inputs, dict) else None


def wants_full_sequence(model) -> bool:
    """Most models' generation step slices `input_ids` to the token not yet in the cache; a model
    without a KV cache (openai-gpt) or one whose forward slices off the cached prefix itself (cpmant)
    keeps all of them."""
    import torch

    ids = torch.ones((1, 3), dtype=torch.long)
    got = (_prepared(model, ids) or {}).get("input_ids")
    return got is not None and got.shape[-1] == ids.shape[-1]


def decodes_without_mask(model) -> bool:
    """mamba's mixer multiplies the new token's states by the mask it is given, which would
    broadcast the one token over the whole sequence's mask: its step gives a decode step none."""
    import torch

    inputs = _prepared(model, torch.ones((1, 3), dtype=torch.long), is_first_iteration=False)
    return inputs is not None and "attention_mask" in inputs and inputs["attention_mask"] is None


def builds_own_step(model) -> bool:
    """The model's generation step feeds it tokens that are not the sequence's (xlm)."""
    import torch

    ids = torch.arange(3, dtype=torch.long)[None] + 1
    got = (_prepared(model, ids) or {}).get("input_ids")
    if got is None or got.shape[0] != 1 or got.shape[-1] == 0:
        return False
    # Most return the whole sequence or its tail; anything else is the model's own input.
    return got.shape[-1] > ids.shape[-1] or not torch.equal(got[0], ids[0, -got.shape[-1]:])


def generation_cache(model, traits: StepTraits):
    """The cache transformers' generate() starts a generation with: a DynamicCache of the model's
    text config, which the forward fills in place whether or not it returns it (xlm's and
    recurrent_gemma's do not); None for a model that carries its own state under another name
    (rwkv `state`, xlnet `mems`) or says it makes its own cache (`_supports_default_dynamic_cache`)."""
    supports_default = getattr(model, "_supports_default_dynamic_cache", None)
    if not traits.carries_a_cache or (supports_default is not None and not supports_default()):
        return None
    from transformers.cache_utils import DynamicCache

    config = model.config
    return DynamicCache(config=config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config)
