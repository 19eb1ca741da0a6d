"""Rotary with a rope base per layer (agent/recipe/native/parts/rotary_layer_theta.py; code: parts/code/rotary.py's
layer_rope_bases / with_rope_theta, parts/code/causal_lm.py and parts/code/attention_fused.py ROPE_BY_LAYER_THETA):
granite_swa and granitemoe_swa keep one rotary table per distinct config.layer_rope_theta (a base of 0: the layer
has no rotary), read at run time. Each type is derived on its default config with granite-3.1's multipliers (the
defaults' attention_multiplier 1.0 makes a random model's logits too peaked to compare in bfloat16), the
full-attention layers on another base than the sliding ones and a layer without rotary, and its file held to
transformers in float32 and
bfloat16 and on the family settings it reads; a file whose sliding and full layers' tables are swapped, or whose
base-0 layer rotates, fails the same check. granite_swa's check with the swapped tables runs by default; the rest
are slow (the default case of their path: test_granite_swa_file_matches_transformers_and_swapped_bases_fail)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from part_selfcheck import selfcheck_with_faults

FULL_BASE, SLIDING_BASE = 1.0e6, 1.0e4
# ibm-granite/granite-3.1-8b-instruct's multipliers (agent.testing.checkpoint_shapes "granite"; 1 / head_dim of 128,
# as both types' default heads are)
GRANITE_MULTIPLIERS = {"attention_multiplier": 0.0078125, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                       "logits_scaling": 16.0}
# the full and the sliding layers' tables swapped (two bases: the list built the other way round)
SWAPPED = ('for theta in layer_rope_bases(config, "layer_rope_theta")])',
           'for theta in reversed(layer_rope_bases(config, "layer_rope_theta"))])')
# a layer of base 0 rotated all the same
NOPE_ROTATED = ("return bool(config.layer_rope_theta[layer_idx])", "return True")


def layer_bases_config(model_type: str) -> dict:
    """The type's default config, its full-attention layers on FULL_BASE, the sliding ones on SLIDING_BASE, layer 1
    (sliding) without rotary: the shrunk model keeps layers 0-2, one of each."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type).to_dict()
    bases = [FULL_BASE if kind == "full_attention" else SLIDING_BASE for kind in config["layer_types"]]
    bases[1] = 0
    assert config["layer_types"][:3] == ["full_attention", "sliding_attention", "sliding_attention"]
    return {**config, **GRANITE_MULTIPLIERS, "layer_rope_theta": bases}


@pytest.fixture(scope="module")
def derived():
    from agent.recipe.native.compose import derive

    found = {}

    def get(model_type):
        if model_type not in found:
            config = layer_bases_config(model_type)
            found[model_type] = (config, derive(config))
        return found[model_type]
    return get


@pytest.mark.parametrize("model_type", ["granite_swa",
                                        pytest.param("granitemoe_swa", marks=pytest.mark.slow)])
def test_the_per_layer_bases_are_read_from_the_architecture(derived, model_type):
    """granitemoe_swa's case is slow (its derive; the default case of its path: granite_swa's)."""
    _, composition = derived(model_type)
    assert composition.parts["position"] == "rotary_layer_theta"
    assert composition.options["ROPE_BY_LAYER_THETA"] == "layer_rope_theta"
    assert composition.options["NOPE_LAYERS"] == "layer_rope_theta"
    assert composition.parts["attention"] == "fused_paged_sinks" and composition.options["LAYER_TYPE_WINDOWS"]


def test_the_config_key_is_the_list_whose_bases_the_tables_hold():
    from agent.recipe.native.parts.rotary_layer_theta import per_layer_key

    config = SimpleNamespace(num_hidden_layers=3, layer_rope_theta=[5e5, 1e4, 0], layer_types=["a", "b", "b"])
    assert per_layer_key(config, [1e4, 5e5]) == "layer_rope_theta"
    assert per_layer_key(config, [1e4, 1e6]) is None            # tables of another base: no list names them
    assert per_layer_key(config, [1e4]) is None


def test_a_table_of_another_rope_type_is_not_read_as_a_base():
    import torch

    from agent.recipe.native.parts.rotary_layer_theta import table_bases

    dim, base = 16, 5e5
    plain = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    assert table_bases([SimpleNamespace(inv_freq=plain)]) == pytest.approx([base], rel=1e-3)
    assert table_bases([SimpleNamespace(inv_freq=plain / 4)]) is None       # linear-scaled: not one base's
    assert table_bases([SimpleNamespace()]) is None


def test_a_weightless_list_beside_the_layers_is_not_a_list_of_layers():
    import torch

    from agent.recipe.native.parts.layout import weightless_lists

    class Table(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.ones(4), persistent=False)

    base = torch.nn.Module()
    base.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    base.rotary_embs = torch.nn.ModuleList([Table(), Table()])
    base.empty = torch.nn.ModuleList()
    assert weightless_lists(base) == {"rotary_embs"}


def _check(derived, model_type, faults, tmp_path, keep=lambda label: True):
    rows = selfcheck_with_faults({model_type: derived(model_type)}, {model_type: faults}, "GraniteForCausalLM",
                                 tmp_path, keep=keep)
    assert all("differ from transformers" in result["reason"] for _, _, ok, result in rows if not ok)
    return rows


def test_granite_swa_file_matches_transformers_and_swapped_bases_fail(derived, tmp_path):
    """The checkpoint's config in float32 and bfloat16; the family settings are the slow case's."""
    rows = _check(derived, "granite_swa", [SWAPPED], tmp_path, keep=lambda label: label.startswith("the checkpoint's"))
    assert any("bfloat16" in label for _, label, ok, _ in rows if ok)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["granite_swa", "granitemoe_swa"])
def test_every_family_setting_matches_transformers_and_faults_fail(derived, model_type, tmp_path):
    """Slow: the default case of this path is test_granite_swa_file_matches_transformers_and_swapped_bases_fail."""
    rows = _check(derived, model_type, [SWAPPED, NOPE_ROTATED], tmp_path)
    assert any("bfloat16" in label for _, label, ok, _ in rows if ok)
    assert {label for _, label, ok, _ in rows if ok} >= {"layer bases: full and sliding layers apart",
                                                         "layer bases: layer 1 without rotary (base 0)"}
