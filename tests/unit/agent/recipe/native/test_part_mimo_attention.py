"""mimo_v2_flash's attention (agent/recipe/native/parts/attention_heads.py's key/value heads per layer kind,
parts/attention.py's sinks per layer kind and value heads of config.v_head_dim, parts/attention_value_scale.py):
its sliding layers have twice num_key_value_heads and sinks, its values are v_head_dim wide and scaled by
config.attention_value_scale — each read from transformers' layers (the kinds confirmed on a config with them
swapped, the key on one with it halved) and written by the fused attention (KV_HEADS_BY_LAYER_TYPE,
SINK_LAYER_TYPES, V_HEAD_DIM, VALUE_SCALE).

Default: the rules read off the probe. Slow: the file held to transformers in float32, bfloat16 and every family
setting (the layer kinds swapped among them), and faults that must fail: sliding layers built with the config's
key/value heads, the values unscaled."""

from __future__ import annotations

import pytest

from part_selfcheck import selfcheck_with_faults

FAULTS = [
    # every layer built with num_key_value_heads (the architecture's rule for sliding layers dropped)
    ('self.num_key_value_heads *= dict((("sliding_attention", 2),)).get(config.layer_types[layer_idx], 1)',
     "self.num_key_value_heads *= 1"),
    # the values unscaled
    ("value = value * self.value_scale", "value = value"),
]


@pytest.fixture(scope="module")
def probe():
    from transformers import AutoConfig

    from agent.recipe.native.parts.probe import Probe

    return Probe(AutoConfig.for_model("mimo_v2_flash").to_dict())


def test_the_kinds_heads_sinks_and_value_widths_are_read(probe):
    from agent.recipe.native.parts.attention import dense_attention
    from agent.recipe.native.parts.attention_heads import key_heads_by_kind, layer_key_heads

    rule, swapped = key_heads_by_kind(probe)
    assert rule == (("sliding_attention", 2),)
    assert swapped == {"layer_types": ["sliding_attention", "full_attention"]}    # the shrunk [full, sliding]
    assert [layer_key_heads(probe, index) for index in range(2)] == [2, 4]
    facts = dense_attention(probe)
    assert facts["SINK_LAYER_TYPES"] == ("sliding_attention",) and facts["sinks"]
    assert facts["V_HEAD_DIM"] is True and facts["VALUE_SCALE"] == "attention_value_scale"


def test_kinds_the_widths_do_not_follow_are_no_rule(probe):
    """A config whose kinds are swapped but whose k_proj widths stay by layer index is no rule of the kinds."""
    from types import SimpleNamespace

    from agent.recipe.native.parts.attention_heads import key_heads_by_kind

    fake = SimpleNamespace(config=probe.config, layers=probe.layers, head_dim=probe.head_dim, kv_heads=probe.kv_heads,
                           memo={}, variant=lambda changes: SimpleNamespace(
                               config=SimpleNamespace(layer_types=changes["layer_types"]), layers=probe.layers,
                               head_dim=probe.head_dim, kv_heads=probe.kv_heads))
    assert key_heads_by_kind(fake) is None


@pytest.mark.slow
def test_every_setting_matches_transformers_and_the_faults_fail(tmp_path):
    """Slow: the stand-in self-check of a MoE file with its variants is over the default suite's budget for a part.
    Default-suite coverage of the same path: the rules that write it (test_the_kinds_heads_sinks_and_value_widths_are_read);
    the per-step self-check of mimo_v2_flash's file is scripts/native_coverage.py."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    config = AutoConfig.for_model("mimo_v2_flash").to_dict()
    rows = selfcheck_with_faults({"mimo_v2_flash": (config, derive(config))}, {"mimo_v2_flash": FAULTS},
                                 "NativeForCausalLM", tmp_path, keep=lambda label: True)
    assert any(label.startswith("layer kinds swapped") for _, label, _, _ in rows)
