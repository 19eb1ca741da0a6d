"""The attention output gate from a projection of its own (agent/recipe/native/parts/attention_gate.py; the fused
attention's GATE_PROJ in parts/code/attention_fused.py): afmoe's sigmoid(gate_proj(x)) per channel on the attention's
output, read from the module (laguna's softplus one per head too), beam's gate with a per-head bias refused; and
afmoe's MoE routing the sparse-MoE part reads (its block's expert_bias as the selection bias, config.route_scale as
the routed scaling). afmoe's file, at a small size, is held to transformers, and a file whose gate drops its sigmoid
fails the same check (default); every family setting, bfloat16 and the MoE faults: the slow case."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from part_selfcheck import selfcheck_with_faults

# afmoe at a small size: a dense and a sparse layer, a sliding (rotary) and a full (NoPE) layer, 4 experts of which
# 2 per token, a routed scale other than 1 (the file reads config.route_scale)
SMALL = {"num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2, "route_scale": 2.5,
         "layer_types": ["sliding_attention", "full_attention"], "num_dense_layers": 1}
GATE_FAULT = ("gate = torch.sigmoid(gate)", "gate = gate")
# type: faults, (text of the correct file, its faulty replacement)
FAULTS = {"afmoe": [GATE_FAULT,
                    ("choice = scores + self.router.e_score_correction_bias.float()", "choice = scores"),
                    ("weights = weights * self.routed_scaling_factor", "weights = weights")]}


def _afmoe():
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    config = {**AutoConfig.for_model("afmoe").to_dict(), **SMALL}
    return config, derive(config)


@pytest.fixture(scope="module")
def afmoe():
    return _afmoe()


def _probe_of(model_type: str, **changes):
    """(a layer's attention of `model_type` built by transformers at a tiny size, a probe-like record of its
    widths)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=8, num_hidden_layers=1, intermediate_size=16, moe_intermediate_size=16,
                                  num_experts=4, vocab_size=64, **changes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    probe = SimpleNamespace(heads=4, head_dim=8, hidden=32, base=model.model)
    return model.model.layers[0].self_attn, probe


@pytest.mark.parametrize("model_type, changes, want", [
    ("afmoe", {}, {"GATE_PROJ": "gate_proj", "GATE_SOFTPLUS": False, "GATE_PER_HEAD": False}),
    ("laguna", {"gating": "per-head", "num_attention_heads_per_layer": [4]},
     {"GATE_PROJ": "g_proj", "GATE_SOFTPLUS": True, "GATE_PER_HEAD": True}),
    ("laguna", {"gating": "per-channel", "num_attention_heads_per_layer": [4]},
     {"GATE_PROJ": "g_proj", "GATE_SOFTPLUS": True, "GATE_PER_HEAD": False}),
])
def test_the_gate_is_read_from_the_module(model_type, changes, want):
    from agent.recipe.native.parts.attention_gate import output_gate

    assert output_gate(*_probe_of(model_type, **changes)) == want


def test_a_gate_of_another_form_is_refused_by_name():
    """beam's gate has a per-head bias inside the sigmoid (zero as built: a measured gate would not see it)."""
    from agent.recipe.native.not_native import NotNative
    from agent.recipe.native.parts.attention_gate import output_gate

    with pytest.raises(NotNative, match=r"parameters \['gate_bias'\] of its own beside its output gate gate_proj"):
        output_gate(*_probe_of("beam", layer_types=["sliding_attention"], mlp_layer_types=["dense"]))


def test_afmoe_is_read_from_the_architecture(afmoe):
    _, composition = afmoe
    options = composition.options
    assert composition.parts["attention"] == "fused_paged" and composition.parts["moe"] == "sparse_moe"
    assert {k: options[k] for k in ("GATE_PROJ", "GATE_SOFTPLUS", "GATE_PER_HEAD", "NOPE_LAYERS")} == \
        {"GATE_PROJ": "gate_proj", "GATE_SOFTPLUS": False, "GATE_PER_HEAD": False, "NOPE_LAYERS": "global_nope"}
    # the checkpoint's attention gate_proj is not the MLP's gate_proj (its stacked gate_up_proj)
    assert ("\\.self_attn\\.gate_proj\\.", ".self_attn.output_gate.") in options["CHECKPOINT_RENAMES"]
    assert {k: options[k] for k in ("SELECTION_BIAS", "SELECTION_BIAS_NAME", "ROUTED_SCALING", "SCALING_KEY")} == \
        {"SELECTION_BIAS": True, "SELECTION_BIAS_NAME": "expert_bias", "ROUTED_SCALING": True, "SCALING_KEY": "route_scale"}
    assert any(item.startswith("output gate: sigmoid of its own projection per channel") for item in composition.unfused)


def test_the_gated_file_matches_transformers_and_a_dropped_sigmoid_fails(afmoe, tmp_path):
    """Default: afmoe's file in float32 on its small config, and the gate's sigmoid dropped."""
    rows = selfcheck_with_faults({"afmoe": afmoe}, {"afmoe": [GATE_FAULT]}, "AfmoeForCausalLM", tmp_path,
                                 keep=lambda label: label == "the checkpoint's config")
    assert [ok for _, _, ok, _ in rows] == [True, False]
    assert "differ from transformers" in rows[-1][3]["reason"]


@pytest.mark.slow
def test_every_afmoe_setting_matches_transformers_and_the_moe_faults_fail(afmoe, tmp_path):
    """bfloat16 and the family's settings (dense layers, shared experts, rope types, biases, tied embeddings); the
    selection bias and the routed scale dropped. Default-suite coverage of the same path:
    test_the_gated_file_matches_transformers_and_a_dropped_sigmoid_fails."""
    rows = selfcheck_with_faults({"afmoe": afmoe}, FAULTS, "AfmoeForCausalLM", tmp_path, keep=lambda label: True)
    assert "the checkpoint's config in bfloat16" in [label for _, label, ok, _ in rows if ok]
