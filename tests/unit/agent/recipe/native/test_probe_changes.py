"""A family setting is made on the shrunk config whatever name it is given: a key the config class aliases
(attribute_map) is set under the name the class stores, which the config dict holds and which would otherwise win
(agent.recipe.native.parts.probe.shrunk_config / stored_names). Without it bailing_hybrid's `norm_topk_prob`,
`n_shared_experts` and `n_group` settings and every `max_position_embeddings` of a rope setting on gpt2's kin ran
the checkpoint's config unchanged, and passed."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from agent.recipe.native.parts.probe import DROP, shrunk_config, stored_names


def _dict(model_type: str, **keys) -> dict:
    return {**AutoConfig.for_model(model_type, **keys).to_dict(), "model_type": model_type}


@pytest.mark.parametrize("model_type, change, attribute", [
    ("bailing_hybrid", {"norm_topk_prob": False}, ("norm_topk_prob", False)),
    ("bailing_hybrid", {"n_shared_experts": 0}, ("num_shared_experts", 0)),
    ("bailing_hybrid", {"n_group": 2, "topk_group": 1}, ("n_group", 2)),
    ("bailing_hybrid", {"max_position_embeddings": 14}, ("max_position_embeddings", 14)),
    ("gpt2", {"max_position_embeddings": 14}, ("n_positions", 14)),
    ("mixtral", {"num_experts": 2}, ("num_local_experts", 2)),
])
def test_a_change_under_an_aliased_name_is_made(model_type, change, attribute):
    base = shrunk_config(_dict(model_type))
    name, value = attribute
    assert getattr(base, name) != value, "the checkpoint's config already has the changed value: no test"
    assert getattr(shrunk_config(_dict(model_type), change), name) == value


def test_stored_names_maps_aliases_alone():
    assert stored_names("bailing_hybrid", {"norm_topk_prob": False, "topk_group": 1, "x": DROP}) == \
        {"moe_renormalize": False, "topk_group": 1, "x": DROP}
    assert stored_names("no_such_type", {"norm_topk_prob": False}) == {"norm_topk_prob": False}
