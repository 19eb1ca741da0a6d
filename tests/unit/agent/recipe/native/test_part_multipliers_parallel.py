"""Scalar multipliers (agent/recipe/native/parts/scalar_multipliers.py: granite's embedding_multiplier,
residual_multiplier, logits_scaling, attention_multiplier as the softmax scale (parts/attention.py's rule); cohere's
logit_scale) and the parallel decoder layer (parts/block_parallel.py, code parts/code/block_parallel.py: one norm,
h + attn(norm(h)) + mlp(norm(h)), cohere / cohere2 — with the interleaved rotary, and cohere2's NoPE global layers).
Each type, derived on its checkpoint-shaped config (agent.testing.checkpoint_shapes), is held to transformers in
float32 and bfloat16 and on the family settings but the rope types (another checkpoint's multipliers among them); a
file that drops a multiplier, or feeds the MLP the residual stream, fails the same check."""

from __future__ import annotations

import pytest

from part_selfcheck import derive_types, selfcheck_with_faults

# type: (parts expected, options expected, faults: (text of the correct file, its faulty replacement))
TYPES = {
    "granite": ({"embedding": "embedding_multiplier", "block": "pre_norm_residual_multiplier",
                 "head": "lm_head_logits_scaling"},
                {"EMBED_MULTIPLIER": True, "RESIDUAL_MULTIPLIER": True, "LOGITS_SCALING": "logits_scaling",
                 "ATTENTION_MULTIPLIER": True},
                [("self.residual_multiplier = config.residual_multiplier", "self.residual_multiplier = 1.0"),
                 ("hidden_states = hidden_states * self.config.embedding_multiplier", "hidden_states = hidden_states"),
                 ("self.scaling = config.attention_multiplier", "self.scaling = self.head_dim ** -0.5"),
                 ("logits = logits / self.config.logits_scaling", "logits = logits")]),
    "cohere": ({"block": "parallel", "head": "lm_head_logits_scaling", "position": "rotary_interleaved"},
               {"LOGITS_SCALING": "logit_scale"},
               [("attended + self.mlp(hidden_states)", "attended + self.mlp(residual)"),
                ("logits = logits * self.config.logit_scale", "logits = logits")]),
    "cohere2": ({"block": "parallel", "position": "rotary_nope"},
                {"NOPE_LAYERS": "global_nope", "ROPE_INTERLEAVED": True},
                [("self.use_rope = layer_uses_rope(config, layer_idx)", "self.use_rope = True")]),
}


@pytest.fixture(scope="module")
def derived():
    return derive_types(TYPES)


def test_the_parts_are_read_from_the_architecture(derived):
    for model_type, (parts, options, _) in TYPES.items():
        composition = derived[model_type][1]
        assert {slot: composition.parts.get(slot) for slot in parts} == parts, (model_type, composition.parts)
        assert {k: composition.options.get(k) for k in options} == options, model_type
    assert any(label == "scalar multipliers" for label, _ in derived["granite"][1].checked_variants)


def test_multipliers_at_one_are_read_on_another_value():
    """granite's defaults hold every multiplier at 1.0, where its effect cannot be seen: the parts read it at
    another value, so the file of such a checkpoint still serves the family's others."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    composition = derive(AutoConfig.for_model("granite").to_dict())
    assert (composition.parts["embedding"], composition.parts["block"], composition.parts["head"]) == \
        ("embedding_multiplier", "pre_norm_residual_multiplier", "lm_head_logits_scaling")


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_model_without_multipliers_keeps_its_parts(model_type):
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    composition = derive(AutoConfig.for_model(model_type).to_dict())
    assert (composition.parts["embedding"], composition.parts["block"], composition.parts["head"]) == \
        ("embedding", "pre_norm", "lm_head")
    assert not composition.options.get("ATTENTION_MULTIPLIER")


@pytest.mark.parametrize("key, value, reason", [
    ("embedding_multiplier", 3.0, "embedding_multiplier"),
    ("residual_multiplier", 0.5, "residual_multiplier"),
    ("logits_scaling", 4.0, "logits_scaling"),
])
def test_a_multiplier_the_model_does_not_apply_is_refused(key, value, reason):
    """A llama config given the key: transformers' llama ignores it, so the part must not write it."""
    from transformers import AutoConfig

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.probe import Probe
    from agent.recipe.native.parts.scalar_multipliers import EMBEDDING_MULTIPLIER, LOGITS_SCALING, RESIDUAL_MULTIPLIER

    part = {"embedding_multiplier": EMBEDDING_MULTIPLIER, "residual_multiplier": RESIDUAL_MULTIPLIER,
            "logits_scaling": LOGITS_SCALING}[key]
    probe = Probe(AutoConfig.for_model("llama").to_dict(), {key: value})
    with pytest.raises(NotNative, match=reason):
        part.probe(probe, {})


def test_multiplier_and_parallel_files_match_transformers_and_faults_fail(derived, tmp_path):
    """Per step against transformers (agent.recipe.native.selfcheck) in float32 and bfloat16 and on each family
    setting but the rope types, one stand-in process."""
    selfcheck_with_faults(derived, {t: faults for t, (_, _, faults) in TYPES.items()}, "MpForCausalLM", tmp_path)
