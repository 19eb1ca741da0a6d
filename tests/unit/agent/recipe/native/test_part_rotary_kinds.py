"""The interleaved rotary (agent/recipe/native/parts/rotary_interleaved.py: glm, ernie4_5 — q/k rows reordered at
load, parts/code/attention_fused.py ROPE_INTERLEAVED) and rotary on some layers only (parts/rotary_nope.py:
smollm3's no_rope_layers, exaone4's NoPE full-attention layers — NOPE_LAYERS). Each type, derived on its
checkpoint-shaped config (agent.testing.checkpoint_shapes), is held to transformers in float32 and bfloat16 and on
the family settings but the rope types (test_part_rotary.py covers those); a file that reorders the rows the wrong
way, or rotates every layer, fails the same check."""

from __future__ import annotations

import pytest

from part_selfcheck import derive_types, selfcheck_with_faults

REORDER = ("rotary[:, 0::2], rotary[:, 1::2]", "rotary[:, 1::2], rotary[:, 0::2]")
EVERY_LAYER = ("self.use_rope = layer_uses_rope(config, layer_idx)", "self.use_rope = True")
# type: (position part, its option, faults: (text of the correct file, its faulty replacement))
TYPES = {
    "glm": ("rotary_interleaved", {"ROPE_INTERLEAVED": True}, [REORDER]),
    "ernie4_5": ("rotary_interleaved", {"ROPE_INTERLEAVED": True}, [REORDER]),
    "smollm3": ("rotary_nope", {"NOPE_LAYERS": "no_rope_layers"}, [EVERY_LAYER]),
    "exaone4": ("rotary_nope", {"NOPE_LAYERS": "global_nope"}, [EVERY_LAYER]),
}


@pytest.fixture(scope="module")
def derived():
    return derive_types(TYPES)


@pytest.mark.parametrize("model_type, want", [("glm", True), ("ernie4_5", True), ("cohere", True),
                                              ("llama", False), ("gpt_oss", False)])
def test_the_interleaved_form_is_read_off_apply_rotary_pos_emb(model_type, want):
    import importlib

    from agent.recipe.native.parts.rotary_interleaved import interleaved_form

    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    assert interleaved_form(modeling) is want


@pytest.mark.parametrize("width, rotary", [(8, 8), (8, 4), (6, 4)])
def test_reordered_rows_make_rotate_half_the_interleaved_rotary(width, rotary):
    """q . k of the interleaved rotary equals q . k of rotate-half on the reordered rows (what the file computes);
    the pairs left in place do not."""
    import torch

    from agent.recipe.native.parts.code.rotary import half_from_interleaved

    gen = torch.Generator().manual_seed(1)
    q, k, angles = torch.randn(2, width, generator=gen), torch.randn(2, width, generator=gen), torch.randn(rotary // 2, generator=gen)

    def interleaved(x, a):
        x1, x2 = x[:, :rotary][:, 0::2], x[:, :rotary][:, 1::2]
        rot = torch.stack((x1 * a.cos() - x2 * a.sin(), x2 * a.cos() + x1 * a.sin()), -1).flatten(-2)
        return torch.cat((rot, x[:, rotary:]), -1)

    def half(x, a):
        x1, x2 = x[:, :rotary // 2], x[:, rotary // 2:rotary]
        return torch.cat((x1 * a.cos() - x2 * a.sin(), x2 * a.cos() + x1 * a.sin(), x[:, rotary:]), -1)

    want = interleaved(q, angles) @ interleaved(k, 2 * angles).T
    got = half(half_from_interleaved(q.reshape(-1), width, rotary).reshape(2, width), angles) @ \
        half(half_from_interleaved(k.reshape(-1), width, rotary).reshape(2, width), 2 * angles).T
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(half(q, angles) @ half(k, 2 * angles).T, want, atol=1e-3)


def test_the_nope_layers_are_read_and_a_pattern_no_rule_gives_is_refused():
    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.probe import Probe
    from agent.recipe.native.parts.rotary_nope import nope_rule, rotating_layers
    from agent.testing.checkpoint_shapes import checkpoint_config

    probe = Probe(checkpoint_config("smollm3")[0])
    rotating = rotating_layers(probe)
    assert rotating == tuple(bool(probe.config.no_rope_layers[i]) for i in range(len(probe.layers)))
    assert not all(rotating) and any(rotating)
    assert nope_rule(probe) == "no_rope_layers"
    # the attention's layers and the config disagree: no rule the file reads gives them
    probe.config.no_rope_layers = [0 if value else 1 for value in probe.config.no_rope_layers]
    with pytest.raises(NotNative, match="NoPE"):
        nope_rule(probe)
    from transformers import AutoConfig

    assert nope_rule(Probe(AutoConfig.for_model("llama").to_dict())) is None


def test_the_parts_are_read_from_the_architecture(derived):
    for model_type, (part, options, _) in TYPES.items():
        composition = derived[model_type][1]
        assert composition.parts["position"] == part, (model_type, composition.parts)
        assert {k: composition.options[k] for k in options} == options, model_type
        assert composition.parts["attention"] == "fused_paged", (model_type, composition.parts)
    assert any(label == "nope no_rope_layers" for label, _ in derived["smollm3"][1].checked_variants)


def test_rotary_kinds_match_transformers_and_faults_fail(derived, tmp_path):
    """Per step against transformers (agent.recipe.native.selfcheck) in float32 and bfloat16 and on each family
    setting but the rope types, one stand-in process."""
    selfcheck_with_faults(derived, {t: faults for t, (_, _, faults) in TYPES.items()}, "RkForCausalLM", tmp_path)
