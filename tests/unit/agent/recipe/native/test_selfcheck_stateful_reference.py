"""The self-check's reference for a model with a recurrent state (agent/recipe/native/selfcheck.py Incremental): its
cached decode is held to its own whole-sequence run (5.24's bamba cache drifts), except where the rope follows the
sequence's length (dynamic, longrope), where the two paths differ by design and the paged-cache file computes the
cached one. Holding those to the whole sequence failed every hybrid's rope-dynamic setting (qwen3_next, qwen3_5,
olmo_hybrid, lara_mini: 0.0073-0.084 against tolerances of ~5e-4), so their migrations kept the adapter."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("rope, follows", [
    ({"rope_type": "default", "rope_theta": 10000.0}, False),
    ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, True),
    ({"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0], "long_factor": [1.0]}, True),
])
def test_a_stateful_reference_holds_its_cache_to_the_whole_sequence_unless_the_rope_follows_the_length(rope, follows):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from agent.recipe.native.selfcheck import Incremental, rope_by_length

    config = AutoConfig.for_model("qwen3_next", hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                                  shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16, num_experts=2, num_experts_per_tok=1,
                                  linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                                  linear_value_head_dim=8, vocab_size=64, layer_types=["linear_attention", "full_attention"])
    config.rope_parameters = rope
    assert rope_by_length(config) is follows
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert Incremental(model, 1).stateful is (not follows)


def test_the_rope_is_read_per_layer_type_and_in_5_0s_rope_scaling():
    from types import SimpleNamespace

    from agent.recipe.native.selfcheck import rope_by_length

    per_type = {"full_attention": {"rope_type": "dynamic", "factor": 2.0}, "sliding_attention": {"rope_type": "default"}}
    assert rope_by_length(SimpleNamespace(rope_parameters=per_type))
    assert rope_by_length(SimpleNamespace(rope_parameters=None, rope_scaling={"type": "dynamic", "factor": 2.0}))
    assert not rope_by_length(SimpleNamespace(rope_parameters={"rope_type": "yarn", "factor": 4.0}))
    assert not rope_by_length(SimpleNamespace())
