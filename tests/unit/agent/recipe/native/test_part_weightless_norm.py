"""The LayerNorm without weight or bias (agent/recipe/native/parts/norm_weightless.py, its code
parts/code/norm_weightless.py): olmo's OlmoLayerNorm, its epsilon fixed in transformers' code and measured
numerically. olmo's file, derived on its checkpoint-shaped config (agent.testing.checkpoint_shapes), is held to
transformers in float32 and bfloat16 and on the family settings it reads; a file whose norm drops its epsilon
fails the same check."""

from __future__ import annotations

import pytest

from part_selfcheck import derive_types, selfcheck_with_faults

# type: faults (text of the correct file, its faulty replacement)
TYPES = {"olmo": [("self.normalized_shape, None, None, self.variance_epsilon)",
                   "self.normalized_shape, None, None, 1e-12)")]}


@pytest.fixture(scope="module")
def derived():
    return derive_types(TYPES)


@pytest.mark.parametrize("eps", [1e-5, 1e-6, 3e-4])
def test_the_epsilon_of_a_weightless_layer_norm_is_measured(eps):
    import torch

    from agent.recipe.native.parts.norm_weightless import weightless_eps

    class Weightless(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.layer_norm(x, x.shape[-1:], None, None, eps)

    assert weightless_eps(Weightless(), 16) == pytest.approx(eps, rel=1e-2)


@pytest.mark.parametrize("kind", ["with-weight", "rms"])
def test_what_is_not_a_weightless_layer_norm_is_refused(kind):
    import torch

    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.norm_weightless import weightless_eps

    class WeightlessRms(torch.nn.Module):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)

    module = torch.nn.LayerNorm(16) if kind == "with-weight" else WeightlessRms()
    with pytest.raises(NotNative):
        weightless_eps(module, 16)


def test_olmo_takes_the_weightless_norm(derived):
    from agent.recipe.native.decide import render_native
    from part_selfcheck import ctx

    composition = derived["olmo"][1]
    assert composition.parts["norm"] == "weightless_layer_norm" and composition.options["NORM_EPS"] is None
    text = render_native(ctx("olmo", "WnForCausalLM"), composition)
    assert "nn.Parameter(torch.ones(config.hidden_size))" not in text and "torch_npu.npu_rms_norm(" not in text
    assert "FIXED_NORM_EPS = 1e-5" in text and text.count("LayerNorm(config.hidden_size, eps=FIXED_NORM_EPS)") == 3


def test_weightless_norm_files_match_transformers_and_faults_fail(derived, tmp_path):
    """Per step against transformers (agent.recipe.native.selfcheck) in float32 and bfloat16 and on each family
    setting but the rope types (test_part_rotary.py), one stand-in process."""
    rows = selfcheck_with_faults(derived, TYPES, "WnForCausalLM", tmp_path)
    assert ("olmo", "the checkpoint's config in bfloat16", True) in [row[:3] for row in rows]
