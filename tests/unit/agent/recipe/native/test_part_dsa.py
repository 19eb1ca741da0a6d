"""DeepSeek Sparse Attention (deepseek_v32, glm_moe_dsa) falls back naming its lightning indexer, read from the
module (parts/dsa.py): the indexer's ranking of a prompt's tokens must be the plain-torch formula's, with the rope
form each architecture uses, and a formula with the wrong arithmetic (no ReLU: top-k over the wrong scores) or
the other rope form must not pass for it."""

import pytest

from agent.recipe.native.not_native import NotNative

# (type, the indexer's rope form transformers writes for it)
CASES = [("deepseek_v32", "half"), ("glm_moe_dsa", "interleave")]


@pytest.mark.parametrize("model_type,rope", CASES)
def test_dsa_falls_back_naming_its_indexer_and_a_wrong_formula_fails(model_type, rope):
    import torch
    from transformers import AutoModelForCausalLM

    from agent.recipe.native.parts import dsa, mla
    from agent.testing.tiny_checkpoint import tiny_config

    # index_topk smaller than the probe's prompt: the selection is a real one in the architecture
    config = tiny_config(model_type, 256, num_hidden_layers=1, index_n_heads=4, index_head_dim=16, index_topk=3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with pytest.raises(NotNative) as caught:
        mla.derive_mla(config, list(model.model.layers), model)
    assert caught.value.kind == "attention"
    reason = str(caught.value)
    assert "\n" not in reason
    assert f"DeepSeek Sparse Attention (a lightning indexer, 4 heads x 16, {rope} rope, top 3 cached tokens" in reason, \
        reason

    # the other rope form ranks the same prompt differently: the probe tells them apart
    attention = model.model.layers[0].self_attn
    x = torch.randn(dsa.PROBE_TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(13))
    cos, sin = (t[0] for t in model.model.rotary_emb(x[None], torch.arange(dsa.PROBE_TOKENS)[None]))
    with torch.no_grad():
        q_resid = attention.q_a_layernorm(attention.q_a_proj(x))
        right = dsa.index_scores(attention.indexer, x, q_resid, cos, sin, rope, config)
        other = next(form for form in dsa.ROPE_FORMS if form != rope)
        wrong = dsa.index_scores(attention.indexer, x, q_resid, cos, sin, other, config)
    ranking = [right[s].argsort(descending=True, stable=True)[: s + 1].tolist() for s in range(dsa.PROBE_TOKENS)]
    assert dsa._ranks_by(right, ranking) and not dsa._ranks_by(wrong, ranking)

    # planted fault: top-k over the scores without the ReLU
    with pytest.raises(NotNative, match="ranks tokens by none of the lightning indexer's formulas"):
        dsa.indexer_facts(attention, model, config, relu=False)
