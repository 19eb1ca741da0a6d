"""The post-norm decoder layer (agent/recipe/native/parts/block_post_norm.py, code parts/code/block_post_norm.py)
and q/k norms over all heads' width (parts/attention.py reads the width; code parts/code/norm_qk_full.py, the mean
of squares all-reduced over attn_tp_group): olmo2 (both), olmoe (the full-width q/k norm in a pre-norm MoE model).
Each file, derived on its checkpoint-shaped config (agent.testing.checkpoint_shapes), is held to transformers in
float32 and bfloat16 and on the family settings it reads; a file that joins the residual before the norm, or
normalises q by the wrong width, fails the same check."""

from __future__ import annotations

import pytest

from part_selfcheck import derive_types, selfcheck_with_faults

# type: (block part, faults: (text of the correct file, its faulty replacement))
TYPES = {
    "olmo2": ("post_norm", [
        ("hidden_states = hidden_states + self.post_attention_layernorm(\n"
         "            self.self_attn(hidden_states, cos_sin, forward_metadata))",
         "hidden_states = self.post_attention_layernorm(\n"
         "            hidden_states + self.self_attn(hidden_states, cos_sin, forward_metadata))"),
        ("square_sum / self.width", "square_sum / (self.width // 2)")]),
    "olmoe": ("pre_norm", [("square_sum / self.width", "square_sum / (self.width // 2)")]),
}


@pytest.fixture(scope="module")
def derived():
    return derive_types(TYPES)


@pytest.mark.parametrize("widths, want", [((8, 8), "head"), ((32, 16), "full"), ((32, 8), None), ((16, 16), None)])
def test_qk_norm_width_is_per_head_or_every_heads(widths, want):
    import torch

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.attention import qk_norm_width

    modules = {"q_norm": torch.nn.RMSNorm(widths[0]), "k_norm": torch.nn.RMSNorm(widths[1])}
    if want is None:
        with pytest.raises(NotNative):
            qk_norm_width(modules, 4, 2, 8)
    else:
        assert qk_norm_width(modules, 4, 2, 8) == want


def test_the_parts_are_read_from_the_architecture(derived):
    for model_type, (block, _) in TYPES.items():
        composition = derived[model_type][1]
        assert composition.parts["block"] == block, (model_type, composition.parts)
        assert composition.options["QK_NORM_FULL"] is True and composition.options["QK_NORM"] is False, model_type
    assert derived["olmoe"][1].parts.get("moe") == "sparse_moe"


def test_a_pre_norm_model_with_per_head_norms_keeps_its_parts():
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    composition = derive(AutoConfig.for_model("qwen3").to_dict())
    assert composition.parts["block"] == "pre_norm" and composition.options["QK_NORM"] is True
    assert not composition.options.get("QK_NORM_FULL")


def test_post_norm_files_match_transformers_and_faults_fail(derived, tmp_path):
    """Per step against transformers (agent.recipe.native.selfcheck) in float32 and bfloat16 and on each family
    setting but the rope types (test_part_rotary.py), one stand-in process."""
    selfcheck_with_faults(derived, {t: faults for t, (_, faults) in TYPES.items()}, "PnForCausalLM", tmp_path)
