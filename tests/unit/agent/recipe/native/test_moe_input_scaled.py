"""An MoE block that routes by scaling its experts' inputs (llama4's Llama4TextMoe: every expert run on every
token, its input the hidden state times sigmoid of the router's top-k logit, 0 elsewhere; a shared expert beside)
is read as that routing (agent/recipe/native/parts/moe.py input_scales): the chosen experts and their weights from
the experts' inputs, the file scaling each routed row before the grouped matmul (parts/code/moe.py INPUT_SCALED).
The generated block against transformers' and the fault of scaling the output instead: test_moe_features.py's
llama4_text case."""

from __future__ import annotations

import pytest


def test_scaled_copies_of_the_hidden_states_are_read_as_input_scales():
    import torch

    from agent.recipe.native.parts.moe import input_scales

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=gen)
    scores = torch.zeros(4, 5)
    scores[torch.randint(0, 4, (5,), generator=gen), torch.arange(5)] = torch.rand(5, generator=gen) + 0.1
    routed_in = (scores[..., None] * x).reshape(-1, 8)
    assert torch.allclose(input_scales(x, routed_in), scores.t(), atol=1e-6)
    two = scores.clone()
    two[(scores.argmax(0) + 1) % 4, torch.arange(5)] = 0.5
    assert torch.allclose(input_scales(x, (two[..., None] * x).reshape(-1, 8)), two.t(), atol=1e-6)
    # not scaled copies: an expert's rows transformed otherwise, the tokens' counts unequal, or none chosen
    assert input_scales(x, routed_in + 0.01 * torch.randn(routed_in.shape, generator=gen)) is None
    uneven = scores.clone()
    uneven[:, 0] = 0.3
    assert input_scales(x, (uneven[..., None] * x).reshape(-1, 8)) is None
    assert input_scales(x, 0 * routed_in) is None and input_scales(x, routed_in[:7]) is None
    assert torch.equal(input_scales(x, x), torch.ones(5, 1))


@pytest.mark.slow
def test_llama4_text_routing_is_read_as_input_scaled():
    """Slow (llama4's 48-layer config built on meta and probed); the default case of this path:
    test_moe_features.py's llama4_text block and its fault."""
    from transformers import AutoConfig

    from agent.recipe.native.parts.moe import derive_moe, moe_options

    facts = derive_moe(AutoConfig.for_model("llama4_text"))
    assert facts["input_scaled"] and (facts["scoring"], facts["renormalize"]) == ("sigmoid", False)
    assert (facts["shared"], facts["shared_name"], facts["gate_up_layout"]) == ("plain", "shared_expert", "E,H,2I")
    assert moe_options(facts)["INPUT_SCALED"] is True
    assert any("times its router weight" in line for line in facts["unfused"])


def test_llama4_text_routing_of_two_experts_per_token_is_read_where_a_weight_underflows():
    """Two experts per token (the tiny image-text llama4's text_config): the router's weights scaled until large
    logits' sigmoids tie at 1 drive some chosen experts' sigmoids to exactly 0 in float32, which the experts' inputs do
    not tell from an expert not chosen; the top-k by logits is read on the rows whose chosen weights are all above 0
    (before: "calls its experts with the hidden states alone")."""
    from transformers import AutoConfig

    from agent.recipe.native.parts.moe import derive_moe

    config = AutoConfig.for_model("llama4_text", hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                                  num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64)
    facts = derive_moe(config)
    assert facts["input_scaled"] and facts["select_on_logits"]
