"""The LayerNorm part (agent/recipe/native/parts/norm_layer.py, its code parts/code/norm_layer.py): LayerNorm with a
bias (stablelm, starcoder2), LayerNorm1P's 1 + w (nemotron), read numerically from the architecture's norms with
its epsilon's config key; each type's file, derived on its checkpoint-shaped config
(agent.testing.checkpoint_shapes), held to transformers in float32 and bfloat16 and on the family settings it
reads, and a file with the norm's arithmetic broken fails the same check. starcoder2 needs the plain MLP under
its c_fc / c_proj names too (parts/mlp_plain.py: the loader renames them)."""

from __future__ import annotations

import pytest

from part_selfcheck import ctx, derive_types, selfcheck_with_faults

# type: (norm options the probe reads, (text of the correct file, its faulty replacement))
TYPES = {
    "stablelm": ({"NORM_BIAS": True, "NORM_OFFSET": False, "NORM_EPS": "layer_norm_eps"},
                 ("bias = self.bias.float()", "bias = None")),
    "nemotron": ({"NORM_BIAS": True, "NORM_OFFSET": True, "NORM_EPS": "norm_eps"},
                 ("weight = self.weight.float() + 1.0", "weight = self.weight.float()")),
    "starcoder2": ({"NORM_BIAS": True, "NORM_OFFSET": False, "NORM_EPS": "norm_epsilon"},
                   ('("\\\\.mlp\\\\.c_fc\\\\.", ".mlp.up_proj."),', "")),
}


@pytest.fixture(scope="module")
def derived():
    return derive_types(TYPES)


@pytest.mark.parametrize("make, want", [
    (lambda torch, w: torch.nn.LayerNorm(w, eps=1e-5), (True, False, 1e-5)),
    (lambda torch, w: torch.nn.LayerNorm(w, eps=1e-6, bias=False), (False, False, 1e-6)),
    (lambda torch, w: __import__("transformers.models.nemotron.modeling_nemotron", fromlist=["x"]).NemotronLayerNorm1P(w),
     (True, True, 1e-5)),
], ids=["bias", "no-bias", "1p"])
def test_layer_norm_kinds_are_read_numerically(make, want):
    import torch

    from agent.recipe.native.parts.norm_layer import probe_layer_norm

    assert probe_layer_norm(make(torch, 12), 12) == want


@pytest.mark.parametrize("norm", ["rms", "wrong-width"])
def test_what_is_not_a_layer_norm_is_refused(norm):
    import torch

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.norm_layer import probe_layer_norm

    module = __import__("transformers.models.llama.modeling_llama", fromlist=["x"]).LlamaRMSNorm(12) \
        if norm == "rms" else torch.nn.LayerNorm(10)
    with pytest.raises(NotNative):
        probe_layer_norm(module, 12)


def test_the_layer_norm_part_is_chosen_with_its_config_key(derived):
    from agent.recipe.native.decide import render_native

    for model_type, (options, _) in TYPES.items():
        composition = derived[model_type][1]
        assert composition.parts["norm"] == "layer_norm", (model_type, composition.parts)
        assert {k: composition.options[k] for k in options} == options, model_type
        text = render_native(ctx(model_type, "LnForCausalLM"), composition)
        assert f"eps=config.{options['NORM_EPS']})" in text and "torch_npu.npu_rms_norm(" not in text, model_type
    assert derived["starcoder2"][1].parts["mlp"] == "plain_mlp"


def test_a_rms_norm_model_keeps_its_part():
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    assert derive(AutoConfig.for_model("llama").to_dict()).parts["norm"] == "rms_norm"


def test_layer_norm_files_match_transformers_and_faults_fail(derived, tmp_path):
    """Per step against transformers (agent.recipe.native.selfcheck) in float32 and bfloat16 and on each family
    setting but the rope types (tests/unit/agent/recipe/native/test_part_rotary.py), one stand-in process."""
    rows = selfcheck_with_faults(derived, {t: [fault] for t, (_, fault) in TYPES.items()}, "LnForCausalLM", tmp_path)
    assert ("stablelm", "the checkpoint's config in bfloat16", True) in [row[:3] for row in rows]
