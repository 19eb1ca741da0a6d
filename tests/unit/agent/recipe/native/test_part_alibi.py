"""ALiBi positions (agent/recipe/native/parts/position_alibi.py, its code parts/code/position_alibi.py) and the
attention that adds their bias (parts/attention.py ALIBI_PAGED, code parts/code/attention_alibi.py: the decode in
npu_fused_infer_attention_score_v2 with the bias as its pse_shift, the prefill in plain torch): the slopes against
transformers' own builders, mpt's derived parts (with its hard-coded GELU and 4 x width, an MLP that adds the
residual itself), and mpt's file held to transformers in float32 and bfloat16, a file with the slopes wrong failing
the same check (by default); the bias dropped at prefill, or reversed at decode, fail too (slow: the
default case of their path is the slopes' fault). bloom's file (its embedding norm, per-head fused q/k/v, tanh GELU)
likewise, slow, a file without the embedding norm failing."""

from __future__ import annotations

import pytest

from part_selfcheck import ctx as render_ctx
from part_selfcheck import selfcheck_with_faults

SLOPES_WRONG = ("torch.pow(2.0, -torch.tensor(exponents, dtype=torch.float32))",
                "torch.pow(2.0, -0.5 * torch.tensor(exponents, dtype=torch.float32))")
PREFILL_BIAS_DROPPED = ("* self.scaling + self.alibi(offsets)", "* self.scaling")
DECODE_BIAS_REVERSED = ("self.alibi(columns - (kv_lens - 1))", "self.alibi((kv_lens - 1) - columns)")


@pytest.mark.parametrize("heads", [1, 2, 4, 5, 6, 12, 16, 20, 32, 40])
def test_the_slopes_are_bloom_and_mpt_builders(heads):
    """Both architectures' slopes, every head count (power of two or not), as the part and the file compute them."""
    import importlib

    import torch
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    from agent.recipe.native.parts.position_alibi import alibi_slopes

    code = importlib.import_module("agent.recipe.native.parts.code.position_alibi")
    bloom = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)
    mpt = build_mpt_alibi_tensor(heads, 2, 8)
    assert torch.allclose(alibi_slopes(heads), bloom[:, 0, 1], rtol=1e-6)
    assert torch.allclose(alibi_slopes(heads), mpt[:, 0, 1] - mpt[:, 0, 0], rtol=1e-6)
    assert torch.equal(code.alibi_slopes(heads, 8), alibi_slopes(heads))
    assert torch.allclose(code.alibi_slopes(heads, 4), build_mpt_alibi_tensor(heads, 2, 4)[:, 0, 0].neg(), rtol=1e-6)


def test_the_bias_is_key_minus_query_position_times_the_slope():
    import importlib

    import torch
    from transformers import AutoConfig

    code = importlib.import_module("agent.recipe.native.parts.code.position_alibi")
    config = AutoConfig.for_model("bloom", n_head=8)
    module = code.ModelAlibiSlopes(config, first=4, count=4)      # the second rank's heads at attn_tp_size 2
    offsets = torch.tensor([[-2, -1, 0]])
    bias = module(offsets)
    assert bias.shape == (4, 1, 3)
    assert torch.allclose(bias[:, 0], code.alibi_slopes(8, 8)[4:, None] * offsets.float())


@pytest.fixture(scope="module")
def mpt():
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    config = AutoConfig.for_model("mpt").to_dict()
    return config, derive(config)


def test_mpt_is_read_as_alibi_with_its_fixed_mlp(mpt):
    from agent.recipe.native.decide import render_native

    _, composition = mpt
    assert composition.parts["position"] == "alibi" and composition.parts["attention"] == "alibi_paged"
    options = composition.options
    assert options["ROTARY"] is False and options["ALIBI"] is True
    assert options["ALIBI_BIAS_MAX"].code == "config.attn_config.alibi_bias_max"
    assert options["ACT_FIXED"] == "gelu" and options["WIDTH_FIXED_4X"] is True
    text = render_native(render_ctx("mpt", "MptForCausalLM"), composition)
    assert "pse_shift=pse" in text and 'input_layout="BSH"' in text and "rotary_emb" not in text
    assert "alibi_slopes(config.num_attention_heads, config.attn_config.alibi_bias_max)" in text
    assert "ACT2FN[\"gelu\"]" in text and "4 * config.hidden_size" in text


def test_an_alibi_the_file_does_not_compute_is_refused_naming_it():
    """falcon's ALiBi (bf16-rounded slopes, the bias divided by sqrt(head_dim) in the mask) is not written; its
    rotary checkpoints are not ALiBi."""
    from transformers import AutoConfig

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.position_alibi import ALIBI
    from agent.recipe.native.parts.probe import Probe

    with pytest.raises(NotNative, match="config.alibi"):
        ALIBI.probe(Probe(AutoConfig.for_model("falcon", alibi=True).to_dict()), {})
    assert ALIBI.probe(Probe(AutoConfig.for_model("falcon").to_dict()), {}) is None


def _check(mpt, faults, tmp_path):
    rows = selfcheck_with_faults({"mpt": mpt}, {"mpt": faults}, "MptForCausalLM", tmp_path)
    assert any("bfloat16" in label for _, label, ok, _ in rows if ok)
    assert all("differ from transformers" in result["reason"] for _, _, ok, result in rows if not ok)


def test_the_mpt_file_matches_transformers_and_wrong_slopes_fail(mpt, tmp_path):
    _check(mpt, [SLOPES_WRONG], tmp_path)


@pytest.mark.slow
def test_the_bias_at_prefill_and_at_decode_is_what_the_check_holds(mpt, tmp_path):
    """Slow: the default case of this path is test_the_mpt_file_matches_transformers_and_wrong_slopes_fail."""
    _check(mpt, [PREFILL_BIAS_DROPPED, DECODE_BIAS_REVERSED], tmp_path)


EMBED_NORM_DROPPED = ("hidden_states = self.embed_norm(hidden_states)", "hidden_states = hidden_states")


@pytest.fixture(scope="module")
def bloom():
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    config = AutoConfig.for_model("bloom").to_dict()
    return config, derive(config)


@pytest.mark.slow
def test_bloom_is_read_with_its_embedding_norm_and_per_head_qkv(bloom):
    """Slow (bloom's derive): the default case of the ALiBi path is mpt's."""
    import re

    from agent.recipe.native.decide import render_native

    _, composition = bloom
    options = composition.options
    assert composition.parts["position"] == "alibi" and options["EMBED_NORM"] is True
    assert options["QKV_GROUPS"] == ("kv_heads", "qkv") and options["ACT_FIXED"] == "gelu_pytorch_tanh"
    assert options["ALIBI_BIAS_MAX"] == 8
    renamed = "transformer.word_embeddings_layernorm.weight"
    for pattern, replacement in options["CHECKPOINT_RENAMES"]:
        renamed = re.sub(pattern, replacement, renamed, count=1)
    assert renamed == "model.embed_norm.weight"
    text = render_native(render_ctx("bloom", "BloomForCausalLM"), composition)
    assert text.count(EMBED_NORM_DROPPED[0]) == 1


def test_a_residual_taken_after_the_norm_falls_back_naming_it():
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.not_native import NotNative

    with pytest.raises(NotNative, match="apply_residual_connection_post_layernorm"):
        derive(AutoConfig.for_model("bloom", apply_residual_connection_post_layernorm=True).to_dict())


@pytest.mark.slow
def test_the_bloom_file_matches_transformers_and_faults_fail(bloom, tmp_path):
    """Slow: the default case of the ALiBi path is mpt's (test_the_mpt_file_matches_transformers_and_wrong_slopes_fail);
    the embedding norm dropped must fail."""
    rows = selfcheck_with_faults({"bloom": bloom}, {"bloom": [EMBED_NORM_DROPPED, SLOPES_WRONG]}, "BloomForCausalLM",
                                 tmp_path)
    assert any("bfloat16" in label for _, label, ok, _ in rows if ok)


@pytest.mark.slow
def test_mpts_clamped_qkv_falls_back_naming_it():
    """Slow (a derive): mpt checkpoints with attn_config.clip_qkv keep the adapter."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.not_native import NotNative

    with pytest.raises(NotNative, match="clip_qkv"):
        derive(AutoConfig.for_model("mpt", attn_config={"clip_qkv": 8.0}).to_dict())
