"""A rotary table held by each attention rather than the base model (moshi's `self_attn.rotary_emb`), read by the
layout as the base model's (parts/layout.py _lift_attention_rotary) so the position part probes it as any rotary;
tables that differ between layers stay with their attentions. moshi's derivation then stops at its next blocker, the
attention's MoshiLinear-wrapped projections (`q_proj.linear`): slow case below."""

from __future__ import annotations

import pytest


def _moshi(**changes):
    from transformers import AutoConfig, MoshiForCausalLM

    config = AutoConfig.for_model("moshi", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=4, head_dim=16, ffn_dim=128, vocab_size=32, **changes)
    return MoshiForCausalLM(config)


def test_each_attentions_one_rotary_is_read_as_the_base_models():
    from agent.recipe.native.parts.layout import read_layout
    from agent.recipe.native.parts.probe import children

    model = _moshi()
    read_layout(model, 64)
    base = model.model
    assert children(base)["rotary_emb"] is base.layers[0].self_attn.rotary_emb
    assert all("rotary_emb" not in children(layer.self_attn) for layer in base.layers)
    assert "rotary_emb" not in dict(base.named_children())      # shown to the probe, not moved in the model


def test_rotaries_that_differ_by_layer_stay_with_their_attentions():
    import torch

    from agent.recipe.native.parts.layout import read_layout
    from agent.recipe.native.parts.probe import children

    model = _moshi()
    with torch.no_grad():
        model.model.layers[1].self_attn.rotary_emb.inv_freq.mul_(2.0)
    read_layout(model, 64)
    assert "rotary_emb" not in children(model.model)
    assert "rotary_emb" in children(model.model.layers[0].self_attn)


@pytest.mark.slow
def test_moshi_falls_back_at_its_wrapped_projections_not_its_rotary():
    """Default case covering the layout's path: test_each_attentions_one_rotary_is_read_as_the_base_models."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.not_native import NotNative

    with pytest.raises(NotNative) as refused:
        derive(AutoConfig.for_model("moshi").to_dict())
    assert refused.value.kind == "attention" and "not plain linears" in refused.value.reason
