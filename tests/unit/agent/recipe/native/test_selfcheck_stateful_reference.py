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


def test_a_cached_decode_astray_by_more_than_the_checks_own_tolerance_gives_way_to_the_whole_sequence():
    """A float32 stateful reference whose cached decode strays from its whole-sequence run by 5e-4 of the largest
    logit (jamba's, on a prompt no longer than its conv's history: within the old 1e-3, ten times the check's own
    1e-4) is held by its whole-sequence logits from that step on; one that strays by 1e-6 keeps its cached ones."""
    import torch

    from agent.recipe.native.selfcheck import TOLERANCE, Incremental

    class Drifting(torch.nn.Module):
        _is_stateful = True

        def __init__(self, drift):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 8))
            self.config, self.drift = type("Config", (), {})(), drift

        def forward(self, input_ids, past_key_values=None, use_cache=False):
            # the logits follow the sum of the tokens so far: the cache holds the earlier ones' sum
            total = float(input_ids.sum()) + (past_key_values or 0.0)
            logits = self.weight * total
            if past_key_values is not None:
                logits = logits * (1 + self.drift)          # the cached path, off by `drift`
            return type("Out", (), {"logits": logits[None, None], "past_key_values": total})()

    for drift, whole in ((5 * TOLERANCE, True), (1e-6, False)):
        reference = Incremental(Drifting(drift), 1)
        reference.logits(0, [1, 2, 3])
        got = reference.logits(0, [1, 2, 3, 4])
        want = torch.linspace(-1.0, 1.0, 8) * 10 * (1 if whole else 1 + drift)
        assert torch.allclose(got, want, rtol=1e-7, atol=0), (drift, got, want)
        assert reference.whole[0] is whole
