"""The probe's shrunk config (agent/recipe/native/parts/probe.py) keeps special token ids inside its small
vocabulary: a bos / eos id past it becomes the last id (cwm's config types bos_token_id as int: None is refused),
a pad id past it none (no padding row outside the vocabulary)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("model_type, changes", [("cwm", {}), ("llama", {"pad_token_id": 128004, "bos_token_id": 128000})])
def test_special_ids_past_the_probe_vocabulary_stay_valid(model_type, changes):
    from transformers import AutoConfig

    from agent.recipe.native.parts.probe import PROBE_VOCAB, shrunk_config

    config = AutoConfig.for_model(model_type, **changes).to_dict()
    assert config["bos_token_id"] >= PROBE_VOCAB
    shrunk = shrunk_config(config)
    assert shrunk.vocab_size == PROBE_VOCAB and shrunk.bos_token_id == PROBE_VOCAB - 1
    if changes:
        assert shrunk.pad_token_id is None
