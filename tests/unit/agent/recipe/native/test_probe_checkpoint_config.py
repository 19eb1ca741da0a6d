"""The probe on the checkpoint's own config (issue 46.3): a type whose transformers defaults are no published
checkpoint (deepseek_v2's routing, dots1's layout, ministral's rope) derives on its checkpoint-shaped config
(agent.testing.checkpoint_shapes) where its defaults crash the probe, and decide.type_note answers for the config
it is given; every recorded shape builds in transformers; the probe's shrunk config keeps special token ids inside
its small vocabulary (a bos / eos id past it becomes the last id: cwm's config types bos_token_id as int, None is
refused; a pad id past it none: no padding row outside the vocabulary)."""

from __future__ import annotations

import pytest


def test_every_recorded_checkpoint_shape_builds():
    from agent.testing.checkpoint_shapes import SHAPES, checkpoint_config

    for model_type, (_, keys) in SHAPES.items():
        config, source = checkpoint_config(model_type)
        assert config["model_type"] == model_type and source
        for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "n_routed_experts", "first_k_dense_replace"):
            if key in keys and key in config:
                assert config[key] == keys[key], (model_type, key)
    assert checkpoint_config("no_such_type") is None


@pytest.mark.parametrize("model_type", ["deepseek_v2", "dots1", "ministral"])
def test_a_type_is_answered_for_the_checkpoint_config_it_is_given(model_type):
    from agent.recipe.native.decide import type_note
    from agent.testing.checkpoint_shapes import checkpoint_config

    assert "does not write" in type_note(model_type)            # transformers' defaults: the probe fails on them
    config, _ = checkpoint_config(model_type)
    assert type_note(model_type, config) == "a type the native generator writes"


@pytest.mark.parametrize("model_type, changes", [("cwm", {}), ("llama", {"pad_token_id": 128004, "bos_token_id": 128000})])
def test_special_ids_past_the_probe_vocabulary_stay_valid(model_type, changes):
    from transformers import AutoConfig

    from agent.recipe.native.parts.probe import PROBE_VOCAB, shrunk_config

    config = AutoConfig.for_model(model_type, **changes).to_dict()
    assert config["bos_token_id"] >= PROBE_VOCAB
    shrunk = shrunk_config(config)
    assert shrunk.vocab_size == PROBE_VOCAB and shrunk.bos_token_id == PROBE_VOCAB - 1
    if changes:
        assert shrunk.pad_token_id is None


def test_a_partial_config_is_shrunk_from_the_sizes_transformers_reads():
    """An image-text checkpoint's text part may be {"model_type": "qwen2"} alone (InternVL's llm_config): the probe
    shrinks transformers' sizes for it, not a full-size model in float32."""
    from agent.recipe.native.parts.probe import PROBE_VOCAB, shrunk_config

    shrunk = shrunk_config({"model_type": "qwen2"})
    assert shrunk.hidden_size <= 512 and shrunk.num_hidden_layers <= 4 and shrunk.vocab_size == PROBE_VOCAB


@pytest.mark.parametrize("model_type", ["rwkv", "xlstm"])
def test_a_model_without_attention_heads_falls_back_naming_its_kind(model_type):
    """A recurrent / state-space model is a fall-back with its layer kind, not a crash inside the probe."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.not_native import NotNative

    with pytest.raises(NotNative) as caught:
        derive(AutoConfig.for_model(model_type).to_dict())
    assert caught.value.kind == "attention" and "state-space" in caught.value.reason


def test_a_per_layer_list_in_a_variant_is_cut_to_the_probes_layers():
    """A config change that states every layer (mlp_layer_types, to make layer 0 dense) applies to the layers the
    probe keeps: cohere2_moe derives, its dense MLP read on that variant."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.parts.probe import Probe

    config = AutoConfig.for_model("cohere2_moe").to_dict()
    probe = Probe(config)
    full = ["dense"] + ["sparse"] * (config["num_hidden_layers"] - 1)
    variant = probe.variant({"mlp_layer_types": full})
    assert variant.config.mlp_layer_types == full[:probe.config.num_hidden_layers]
    composition = derive(config)
    assert composition.parts["mlp"] and composition.parts["moe"]


@pytest.mark.parametrize("model_type, changes, named", [
    # (gemma4's head_dim and key/value heads per layer are written: test_part_gemma4_layers.py; dots3_note_text's MLA
    # widths per layer are parts/mla_layer_shapes.py's: test_part_mla_layer_shapes.py)
    # query heads per layer through per_layer_config: the shrunk layers agree (8 and 4 both shrink to 4), the
    # config's do not
    ("gemma4_text", {"num_hidden_layers": 6, "hidden_size_per_layer_input": 0,
                     "per_layer_config": {5: {"num_attention_heads": 4}}}, ["num_attention_heads 8/4"]),
])
def test_a_config_that_sets_attention_shapes_per_layer_falls_back_naming_them(model_type, changes, named):
    """A heterogeneous config (transformers' per_layer_config: here a layer's own query heads) refuses a global read
    of what it sets per layer that no part writes layer by layer: a fall-back that names each such attribute with
    the checkpoint's values, not a crash in whichever part reads one first."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.not_native import NotNative

    config = AutoConfig.for_model(model_type, **changes).to_dict()
    with pytest.raises(NotNative) as caught:
        derive(config)
    assert caught.value.kind == "attention", caught.value
    reason = caught.value.reason
    assert "\n" not in reason and "per layer (per_layer_config)" in reason, reason
    for text in named:
        assert text in reason, reason


def test_what_a_config_sets_per_layer_is_read_layer_by_layer():
    """varying_per_layer: the attributes that differ between layers, their values in layer order; an override equal
    in every layer still counts (transformers refuses its global read all the same); a homogeneous config: none."""
    from transformers import AutoConfig

    from agent.recipe.native.parts.probe import per_layer_refusal, varying_per_layer

    gemma4 = AutoConfig.for_model("gemma4_text", num_hidden_layers=6)
    assert varying_per_layer(gemma4) == {"head_dim": [256, 512]}
    same = AutoConfig.for_model("gemma4_text", num_hidden_layers=6, per_layer_config={i: {"head_dim": 64}
                                                                                      for i in range(6)})
    assert varying_per_layer(same) == {"head_dim": [64]}
    # head_dim and the key/value heads are what parts write per layer (parts/attention_head_dim.py,
    # parts/attention_heads.py); any other attribute still refuses
    assert per_layer_refusal(gemma4) is None and per_layer_refusal(same) is None
    key_heads = AutoConfig.for_model("gemma4_text", num_hidden_layers=6, per_layer_config={5: {"num_key_value_heads": 2}})
    assert varying_per_layer(key_heads) == {"num_key_value_heads": [4, 2]} and per_layer_refusal(key_heads) is None
    heads = AutoConfig.for_model("gemma4_text", num_hidden_layers=6, per_layer_config={5: {"num_attention_heads": 4}})
    assert "num_attention_heads 8/4 per layer" in per_layer_refusal(heads)
    assert varying_per_layer(AutoConfig.for_model("llama")) == {} and per_layer_refusal(AutoConfig.for_model("llama")) is None