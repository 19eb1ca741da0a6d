"""An MoE block that routes by scaling its experts' inputs (llama4's Llama4TextMoe: every expert run on every
token, its input the hidden state times sigmoid of the router's top-k logit, 0 elsewhere; a shared expert beside)
falls back in one line naming that form (agent/recipe/native/parts/moe.py input_scaled_routing), not the generic
"hidden states alone" reading."""

from __future__ import annotations

import pytest


def test_scaled_copies_of_the_hidden_states_are_read_as_input_scaled_routing():
    import torch

    from agent.recipe.native.parts.moe import input_scaled_routing

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=gen)
    scores = torch.zeros(4, 5)
    scores[torch.randint(0, 4, (5,), generator=gen), torch.arange(5)] = torch.rand(5, generator=gen) + 0.1
    routed_in = (scores[..., None] * x).reshape(-1, 8)
    assert input_scaled_routing(x, routed_in) == 1
    assert input_scaled_routing(x[None], routed_in) == 1                 # the probe's [1, tokens, hidden]
    two = scores.clone()
    two[(scores.argmax(0) + 1) % 4, torch.arange(5)] = 0.5
    assert input_scaled_routing(x, (two[..., None] * x).reshape(-1, 8)) == 2
    # not scaled copies: an expert's rows transformed otherwise, or the tokens' counts unequal
    assert input_scaled_routing(x, routed_in + 0.01 * torch.randn(routed_in.shape, generator=gen)) is None
    uneven = scores.clone()
    uneven[:, 0] = 0.3
    assert input_scaled_routing(x, (uneven[..., None] * x).reshape(-1, 8)) is None
    assert input_scaled_routing(x, x) == 1 and input_scaled_routing(x, routed_in[:7]) is None


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llama4_text", "llama4"])
def test_llama4_falls_back_naming_its_input_scaled_routing(model_type):
    """Slow (llama4's derive); the default case of this path:
    test_scaled_copies_of_the_hidden_states_are_read_as_input_scaled_routing."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.not_native import NotNative

    with pytest.raises(NotNative) as refused:
        derive(AutoConfig.for_model(model_type).to_dict())
    assert refused.value.kind == "moe", refused.value
    assert "scales each routed expert's input (not its output)" in refused.value.reason
    assert "1 of them with an input not 0 per token" in refused.value.reason and "\n" not in refused.value.reason
