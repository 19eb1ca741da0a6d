"""The self-check's transformers references: each on its own copy of the config (agent.recipe.native.selfcheck
reference_model)."""

from __future__ import annotations


def test_a_reference_switched_to_another_implementation_leaves_the_others():
    """Each reference model holds its own config: switching one to transformers' other attention and experts leaves
    another built on the same config on theirs (transformers' from_config keeps the config object it is handed, and
    its modules read the implementation from it at every forward)."""
    from transformers import AutoConfig

    from agent.recipe.native.selfcheck import reference_model

    config = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  num_experts=4, num_experts_per_tok=2, vocab_size=64)
    config._attn_implementation, config._experts_implementation = "eager", "eager"
    first, second = reference_model(config), reference_model(config)
    second.set_attn_implementation("sdpa")
    second.set_experts_implementation("grouped_mm")
    assert (second.config._attn_implementation, second.config._experts_implementation) == ("sdpa", "grouped_mm")
    assert (first.config._attn_implementation, first.config._experts_implementation) == ("eager", "eager")
    assert (config._attn_implementation, config._experts_implementation) == ("eager", "eager")
