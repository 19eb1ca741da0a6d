"""Loading a recipe's model and tokenizer from its checkpoint, and the checks around it.

Recipes never fetch at run time: everything comes from model_path (local_files_only), and weights
that were not in the checkpoint (they would be random) are refused.
"""

from __future__ import annotations

import os
import random

from engine import environment

torch = environment.import_torch()  # through the guard: see engine.environment.import_torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SIMULATED_CARD_ENV = "MIGRATOR_DEVICE_MEMORY_BYTES"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def load_model(model_cls, config, model_path: str, runner_settings: dict, dtype, attn_implementation: str,
               key_mapping: dict | None, parallel_kwargs: dict):
    """The model with the checkpoint's weights, nothing missing or of another shape."""
    reuse_checkpoint_conversions(model_cls, config)
    model, info = model_cls.from_pretrained(
        model_path, config=config, runner_settings=runner_settings, dtype=dtype,
        attn_implementation=attn_implementation, local_files_only=True, output_loading_info=True,
        # key_mapping: regex -> replacement for checkpoint keys named differently from the code.
        key_mapping=key_mapping or None, **parallel_kwargs)
    check_loading_info(info, model_path)
    return model


def check_lengths(config, input_max_len: int, max_new_tokens: int) -> None:
    """Prompt + generated tokens must fit the positions the model was built for."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text_config, "max_position_embeddings", None)
    # A limit of -1 (xlnet) or 0 means none: relative positions.
    if isinstance(limit, int) and limit > 0 and input_max_len + max_new_tokens > limit:
        raise ValueError(
            f"data_config.input_max_len ({input_max_len}) + data_config.max_new_tokens ({max_new_tokens}) "
            f"exceeds max_position_embeddings ({limit}); lower them in the YAML")


def reuse_checkpoint_conversions(model_cls, config) -> None:
    """Apply transformers' checkpoint key conversions (renamed or fused weights) to vendored code.

    transformers applies them only to its own classes; a vendored copy counts as custom code
    and would load with weights silently missing. Registering the same mapping under the
    class name / model_type opts the vendored class in.
    """
    try:
        from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                     register_checkpoint_conversion_mapping)
    except ImportError:  # a transformers without conversions: none to reuse
        return
    for key in (model_cls.__name__, getattr(config, "model_type", None)):
        mapping = get_checkpoint_conversion_mapping(key) if key else None
        if mapping is not None:
            register_checkpoint_conversion_mapping(key, mapping, overwrite=True)


def check_loading_info(info: dict, model_path: str) -> None:
    """Refuse to run with weights that were not in the checkpoint (they would be random)."""
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(str(k) for k in info.get("mismatched_keys") or [])
    if missing or mismatched:
        unexpected = sorted(info.get("unexpected_keys") or [])
        raise RuntimeError(
            f"state dict mismatch loading {model_path}: missing keys {missing[:8]}, "
            f"unexpected keys {unexpected[:8]}, mismatched shapes {mismatched[:8]}")


def load_tokenizer(model_path: str, padding_side: str = "left", trust_remote_code: bool = False):
    """AutoTokenizer from the checkpoint, left padding, and a pad token even if none is defined.
    `trust_remote_code`: the repo's own tokenizer code may run (the migrator passes the user's
    --trust-remote-code); by default never prompt, never run a repo's tokenizer code."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True,
                                              trust_remote_code=trust_remote_code)
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        elif tokenizer.unk_token is not None:
            tokenizer.pad_token = tokenizer.unk_token
        else:
            # Never add a token: its id would fall outside the embedding table. Padded
            # positions are masked out, so any existing id will do.
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(0)
    return tokenizer


def rank_weight_bytes(model) -> int:
    """Bytes of the weights this rank holds: a sharded weight (DTensor or local slice) counts its shard."""
    total = 0
    for param in model.parameters():
        data = param.to_local() if hasattr(param, "to_local") else param
        total += data.numel() * data.element_size()
    return total


def check_device_memory(device, held_bytes: int) -> None:
    """MIGRATOR_DEVICE_MEMORY_BYTES (tests and CPU only): a simulated card of that many bytes.

    A CPU has no per-card memory to run out of; with this set, a rank whose weights exceed the
    "card" fails as a full NPU would. Ignored on real devices.
    """
    card = environment.simulated_card_bytes()      # parsed strictly: a bad value is one line, never a crash
    if card and device.type == "cpu" and held_bytes > card:
        raise torch.OutOfMemoryError(
            f"CPU out of memory (simulated card of {card} bytes, {SIMULATED_CARD_ENV}): "
            f"this rank holds {held_bytes} bytes of weights")
