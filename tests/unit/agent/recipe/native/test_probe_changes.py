"""A family setting is made on the shrunk config whatever name it is given: a key the config class aliases
(attribute_map) is set under both its names, either of which the config dict may hold and which may otherwise win
(agent.recipe.native.parts.probe.shrunk_config / stored_names). Under the alias alone, bailing_hybrid's
`norm_topk_prob`, `n_shared_experts` and `n_group` settings and its rope settings' `max_position_embeddings` (stored as
model_max_length) ran the checkpoint's config unchanged, and passed; under the stored name alone, mpt's probe of a
halved hidden_size kept the shrunk dict's. The gpt2, mixtral and mpt rows hold classes where the alias wins."""

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
    ("mpt", {"hidden_size": 256}, ("d_model", 256)),        # its shrunk dict holds both names
    ("mpt", {"d_model": 256}, ("hidden_size", 256)),        # and a change under the stored one
    ("mixtral", {"num_experts": 2}, ("num_local_experts", 2)),
])
def test_a_change_under_an_aliased_name_is_made(model_type, change, attribute):
    base = shrunk_config(_dict(model_type))
    name, value = attribute
    assert getattr(base, name) != value, "the checkpoint's config already has the changed value: no test"
    assert getattr(shrunk_config(_dict(model_type), change), name) == value


def test_stored_names_maps_aliases_alone():
    assert stored_names("bailing_hybrid", {"norm_topk_prob": False, "topk_group": 1, "n_group": DROP}) == \
        {"norm_topk_prob": False, "moe_renormalize": False, "topk_group": 1, "n_group": DROP, "num_expert_group": DROP}
    assert stored_names("bailing_hybrid", {"moe_renormalize": True}) == \
        {"moe_renormalize": True, "norm_topk_prob": True}
    assert stored_names("no_such_type", {"norm_topk_prob": False}) == {"norm_topk_prob": False}
