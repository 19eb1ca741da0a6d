"""Rope settings per layer type where only some layer types have them (agent/recipe/native/parts/position.py
rope_groups / typed_layers / default_whole_head; code: parts/code/causal_lm.py ROPE_TYPED_LAYERS, parts/code/rotary.py
PROPORTIONAL_ROPE and DEFAULT_WHOLE_HEAD): lfm3 keeps rope_parameters under its attention types' names
(full_attention: proportional, theta 1e6, half the angles; sliding_attention: default, theta 1e4) and none for its
conv layers. Read as one group before (no conv key), the file rotated every attention layer by the default rope of
theta 1e4 and its float32 self-check differed from transformers' by 0.772. The readings run by default on configs
alone; lfm3's whole file, its faults and every family setting are slow."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

TYPED = {"full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}


def _config(params, layer_types):
    return SimpleNamespace(rope_parameters=params, layer_types=layer_types)


def test_rope_settings_are_per_type_where_some_layer_types_have_them():
    from agent.recipe.native.parts.position import rope_groups, typed_layers

    kinds = ["conv", "full_attention", "conv", "sliding_attention"]
    assert rope_groups(_config(TYPED, kinds)) == (True, [TYPED["full_attention"], TYPED["sliding_attention"]])
    # every type keeps its own (gemma3), none does (one group)
    assert rope_groups(_config(TYPED, ["full_attention", "sliding_attention"]))[0]
    plain = {"rope_type": "default", "rope_theta": 1e4}
    assert rope_groups(_config(plain, kinds)) == (False, [plain])
    layers = [SimpleNamespace(), SimpleNamespace(self_attn=1), SimpleNamespace(), SimpleNamespace(self_attn=1)]
    assert typed_layers(SimpleNamespace(config=_config(TYPED, kinds), layers=layers)) == {"ROPE_TYPED_LAYERS": True}
    # an attention layer of a type without settings: refused by the position part, naming the layer
    from agent.recipe.native.not_native import NotNative

    with pytest.raises(NotNative, match=r"layer 3 \(sliding_attention\) attends"):
        typed_layers(SimpleNamespace(config=_config({"full_attention": TYPED["full_attention"]}, kinds),
                                     layers=layers))


def test_the_files_proportional_rope_is_transformers_and_not_a_partial_default():
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers import AutoConfig

    from agent.recipe.native.parts.code.rotary import proportional_inv_freq

    config = AutoConfig.for_model("lfm3")
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](config, None, layer_type="full_attention")
    got = proportional_inv_freq(config.rope_parameters["full_attention"], config.head_dim)
    assert torch.allclose(got, want.float())
    # the partial default rope of the same settings (rotary dims as the exponent's denominator) is another table
    dim = int(config.head_dim * 0.5)
    partial = 1.0 / (1e6 ** (torch.arange(0, dim, 2).float() / dim))
    assert not torch.allclose(got[:dim // 2], partial)


# planted faults in lfm3's file: (correct text, faulty replacement)
FAULTS = [
    # one table for every attention layer (the reading before: the sliding layers' rope on the full ones too)
    ("cos_sin[self.layer_type]", 'cos_sin["sliding_attention"]'),
    # proportional rope's exponent over the rotary dims instead of the whole head
    ("torch.int64).float() / head_dim))", "torch.int64).float() / (2 * angles)))"),
]


@pytest.mark.slow
def test_lfm3_file_matches_transformers_in_every_job_and_faults_fail(tmp_path):
    """lfm3's default config: the per-type tables, proportional on the full-attention layers, default over the
    whole head; float32, bfloat16 and every family setting (each rope type on every attention type) within
    tolerance, each fault fails. Default cases of this path: the two tests above."""
    from transformers import AutoConfig

    from part_selfcheck import selfcheck_with_faults

    from agent.recipe.native.compose import derive

    config = AutoConfig.for_model("lfm3").to_dict()
    composition = derive(config)
    assert composition.parts["position"] == "rotary"
    assert {k: composition.options.get(k) for k in ("ROPE_BY_LAYER_TYPE", "ROPE_TYPED_LAYERS", "PROPORTIONAL_ROPE",
                                                    "DEFAULT_WHOLE_HEAD")} == dict.fromkeys(
        ("ROPE_BY_LAYER_TYPE", "ROPE_TYPED_LAYERS", "PROPORTIONAL_ROPE", "DEFAULT_WHOLE_HEAD"), True)
    rows = selfcheck_with_faults({"lfm3": (config, composition)}, {"lfm3": FAULTS}, "Lfm3ForCausalLM", tmp_path,
                                 keep=lambda label: True)
    assert any(label.startswith("rope ") for _, label, ok, _ in rows if ok), rows
    assert all("differ from transformers" in r["reason"] for _, _, ok, r in rows if not ok), rows
