"""Differential attention (agent/recipe/native/parts/attention_diff.py, its code parts/code/attention_diff.py: two
npu_fused_infer_attention_score_v2 calls on the paged cache, one over the value cache and one over the
swapped-halves value cache, the combination in plain torch): diffllama is derived with it and its file is held to
transformers (a packed prefill and decode steps on the paged cache) in float32 and bfloat16, a file with lambda's
sign flipped failing the same check (the default case). Slow: a grouped-query config (4 query heads over 2 key
heads: the value halves' mapping with groups), the family's settings, the group norm dropped, the swapped value
cache written unswapped, lambda_init of layer 0 for every layer; the probe refusing a layer whose lambda_init or
arithmetic is not the file's."""

from __future__ import annotations

import pytest

from part_selfcheck import ctx as render_ctx
from part_selfcheck import selfcheck_with_faults

CLASS = "DiffLlamaForCausalLM"
LAMBDA_SIGN = ("out = first - (lambda_1 - lambda_2 + self.lambda_init) * second",
               "out = first + (lambda_1 - lambda_2 + self.lambda_init) * second")
NORM_DROPPED = ("torch.nn.functional.rms_norm(out, (2 * self.head_dim,), eps=self.norm_eps)", "out")
SWAP_UNWRITTEN = ("self.head_dim), slots, swapped)", "self.head_dim), slots, value)")
LAMBDA_INIT_LAYER0 = ("self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer_idx)", "self.lambda_init = 0.2")


def _derived(**changes):
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    config = AutoConfig.for_model("diffllama", **changes).to_dict()
    return config, derive(config)


@pytest.fixture(scope="module")
def diffllama():
    return _derived()


DTYPES = ("the checkpoint's config", "the checkpoint's config in bfloat16")


def test_diffllama_is_differential_attention_and_its_file_matches_transformers(diffllama, tmp_path):
    """fp32 and bf16 at the default (smallest) size; lambda's sign flipped must fail."""
    from agent.recipe.native.decide import render_native

    _, composition = diffllama
    assert composition.parts["attention"] == "diff_paged"
    assert any("x2" in item for item in composition.fused)
    text = render_native(render_ctx("diffllama", CLASS), composition)
    assert "class DiffLlamaDiffAttention(nn.Module):" in text and "class DiffLlamaAttention" not in text
    # one fused attention call site, run on the value cache and on the swapped-halves one
    assert text.count("npu_fused_infer_attention_score_v2(") == 1 and text.count("self._paged(query, ") == 2
    rows = selfcheck_with_faults({"diffllama": diffllama}, {"diffllama": [LAMBDA_SIGN]}, CLASS, tmp_path,
                                 keep=lambda label: label in DTYPES)
    assert [label for _, label, ok, _ in rows if ok] == list(DTYPES)
    assert "differ from transformers" in rows[-1][3]["reason"]


@pytest.mark.slow
def test_grouped_query_diffllama_and_the_other_faults(tmp_path):
    """The default case above covers this path (fp32 / bf16, one fault); here: 4 query heads over 2 key heads, every
    family setting, and the group norm dropped, the swapped value cache written unswapped, one lambda_init for
    every layer."""
    derived = {"diffllama": _derived(num_attention_heads=32, num_key_value_heads=8)}
    assert derived["diffllama"][1].parts["attention"] == "diff_paged"
    rows = selfcheck_with_faults(derived, {"diffllama": [NORM_DROPPED, SWAP_UNWRITTEN, LAMBDA_INIT_LAYER0]}, CLASS,
                                 tmp_path, keep=lambda label: True)
    assert {"bias attention_bias", "the checkpoint's config in bfloat16"} <= {label for _, label, ok, _ in rows if ok}


@pytest.mark.slow
def test_the_probe_refuses_another_lambda_init_or_arithmetic():
    """The default case covers the probe's accepting path; a layer's lambda_init moved, its norm's eps changed
    from the config's, or its output rescaled, is refused naming it."""
    from transformers import AutoConfig

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.attention_diff import check_differential
    from agent.recipe.native.parts.probe import Probe

    probe = Probe(AutoConfig.for_model("diffllama", num_attention_heads=32, num_key_value_heads=8).to_dict())
    check_differential(probe)
    module = probe.layers[1].self_attn
    module.lambda_init += 0.1
    with pytest.raises(NotNative, match="layer 1's lambda_init"):
        check_differential(probe)
    module.lambda_init -= 0.1
    probe.layers[0].self_attn.groupnorm.eps = 0.5
    with pytest.raises(NotNative, match="groupnorm"):
        check_differential(probe)
    probe.layers[0].self_attn.groupnorm.eps = probe.config.rms_norm_eps
    forward = type(probe.layers[0].self_attn).forward

    def rescaled(self, *args, **kwargs):          # another arithmetic: the output scaled
        out = forward(self, *args, **kwargs)
        return (out[0] * 1.5, *out[1:])

    probe.layers[0].self_attn.forward = rescaled.__get__(probe.layers[0].self_attn)
    with pytest.raises(NotNative, match="output is not"):
        check_differential(probe)
