"""The attention output gate from a projection of its own (agent/recipe/native/parts/attention_gate.py; the fused
attention's GATE_PROJ in parts/code/attention_fused.py): afmoe's sigmoid(gate_proj(x)) per channel on the attention's
output, read from the module (laguna's softplus one per head too); and
afmoe's MoE routing the sparse-MoE part reads (its block's expert_bias as the selection bias, config.route_scale as
the routed scaling). bitnet's sub-norms (parts/sub_norm.py): an RMSNorm of the attention's output before o_proj and
of the MLP's act(gate) * up before down_proj, each over the whole width tensor parallel splits. afmoe's and bitnet's
files, at a small size, are held to transformers, and a file whose gate drops its sigmoid fails the same check
(default); every family setting, bfloat16 and the other faults: the slow case. The types of issue 46 not
written yet fall back naming what the file does not write."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from part_selfcheck import selfcheck_with_faults

# afmoe at a small size: a dense and a sparse layer, a sliding (rotary) and a full (NoPE) layer, 4 experts of which
# 2 per token, a routed scale other than 1 (the file reads config.route_scale)
SMALL = {"num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2, "route_scale": 2.5,
         "layer_types": ["sliding_attention", "full_attention"], "num_dense_layers": 1}
GATE_FAULT = ("gate = torch.sigmoid(gate)", "gate = gate")
# gpt_neox_japanese's last layer without its o_proj bias (parts/attention_params.py: the checkpoint's dense_bias)
BIAS_FAULT = ("bias=layer_idx == config.num_hidden_layers - 1,", "bias=False,")
# type -> its small config's changes to transformers' defaults
CHANGES = {"afmoe": SMALL, "bitnet": {"num_hidden_layers": 2}, "gpt_neox_japanese": {"num_hidden_layers": 2}}
# type: faults, (text of the correct file, its faulty replacement)
FAULTS = {"afmoe": [GATE_FAULT,
                    ("choice = scores + self.router.e_score_correction_bias.float()", "choice = scores"),
                    ("weights = weights * self.routed_scaling_factor", "weights = weights")],
          "bitnet": [("out = self.attn_sub_norm(out.reshape(q_len, -1))", "out = out.reshape(q_len, -1)"),
                     ("self.down_proj(self.ffn_sub_norm(self.act_fn(gate) * up))", "self.down_proj(self.act_fn(gate) * up)")],
          "gpt_neox_japanese": [BIAS_FAULT]}


@pytest.fixture(scope="module")
def derived():
    """type -> (its small config, its composition)."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    found = {}
    for model_type, changes in CHANGES.items():
        config = {**AutoConfig.for_model(model_type).to_dict(), **changes}
        found[model_type] = (config, derive(config))
    return found


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


# type -> its fall-back reason: the first thing the file does not write, named
REFUSALS = {
    "axk2": r"AXK2GatedRMSNorm holds modules \['mlp', 'norm'\] and no weight of its own",
}


@pytest.mark.parametrize("model_type", sorted(REFUSALS))
def test_what_is_not_written_is_named(model_type):
    """axk2's gated norm (beam is written: test_part_beam.py; laguna's heads per layer: test_part_heads_per_layer.py;
    moshi's MoshiLinear-wrapped q/k/v/o are read: test_layout_attention_rotary.py; mimo_v2_flash's key heads per
    layer kind: test_part_mimo_attention.py)."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive
    from agent.recipe.native.not_native import NotNative

    with pytest.raises(NotNative, match=REFUSALS[model_type]):
        derive(AutoConfig.for_model(model_type).to_dict())


def test_afmoe_is_read_from_the_architecture(derived):
    _, composition = derived["afmoe"]
    options = composition.options
    assert composition.parts["attention"] == "fused_paged" and composition.parts["moe"] == "sparse_moe"
    assert {k: options[k] for k in ("GATE_PROJ", "GATE_SOFTPLUS", "GATE_PER_HEAD", "NOPE_LAYERS")} == \
        {"GATE_PROJ": "gate_proj", "GATE_SOFTPLUS": False, "GATE_PER_HEAD": False, "NOPE_LAYERS": "global_nope"}
    # the checkpoint's attention gate_proj is not the MLP's gate_proj (its stacked gate_up_proj)
    assert ("\\.self_attn\\.gate_proj\\.", ".self_attn.output_gate.") in options["CHECKPOINT_RENAMES"]
    assert {k: options[k] for k in ("SELECTION_BIAS", "SELECTION_BIAS_NAME", "ROUTED_SCALING", "SCALING_KEY")} == \
        {"SELECTION_BIAS": True, "SELECTION_BIAS_NAME": "expert_bias", "ROUTED_SCALING": True, "SCALING_KEY": "route_scale"}
    assert any(item.startswith("output gate: sigmoid of its own projection per channel") for item in composition.unfused)


def test_bitnet_is_read_from_the_architecture(derived):
    _, composition = derived["bitnet"]
    assert composition.parts["attention"] == "fused_paged" and composition.parts["mlp"] == "gated_mlp"
    assert composition.options["ATTN_SUB_NORM"] is True and composition.options["FFN_SUB_NORM"] is True
    assert sum("sub-norm" in item for item in composition.unfused) == 2


def test_gpt_neox_japanese_is_read_from_the_architecture(derived):
    """Its last layer's dense_bias is the file's o_proj bias on that layer (parts/attention_params.py)."""
    from agent.recipe.native.parts.attention_params import LAST_LAYER

    _, composition = derived["gpt_neox_japanese"]
    options = composition.options
    assert composition.parts["attention"] == "fused_paged"
    assert options["O_BIAS"] == LAST_LAYER
    # the checkpoint's dense_bias (after the layout's renames) is the last layer's o_proj bias
    assert ("\\.self_attn\\.dense_bias$", ".self_attn.o_proj.bias") in options["CHECKPOINT_RENAMES"]


def test_the_files_match_transformers_and_a_dropped_gate_sigmoid_fails(derived, tmp_path):
    """Default: afmoe's and gpt_neox_japanese's files in float32 on their small configs, afmoe's gate without its
    sigmoid, gpt_neox_japanese's last layer without its o_proj bias (the checkpoint's dense_bias then loads
    nowhere); bitnet's file (whose bfloat16 run still differs: not native) is slow. (The framework class is the
    test's.)"""
    types = ("afmoe", "gpt_neox_japanese")
    rows = selfcheck_with_faults({t: derived[t] for t in types}, {"afmoe": [GATE_FAULT], "gpt_neox_japanese": [BIAS_FAULT]},
                                 "NativeForCausalLM", tmp_path, keep=lambda label: label == "the checkpoint's config")
    assert [(t, ok) for t, _, ok, _ in rows] == [("afmoe", True), ("afmoe", False), ("gpt_neox_japanese", True),
                                                 ("gpt_neox_japanese", False)]
    assert all("differ from transformers" in r["reason"] for _, _, ok, r in rows if not ok)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(FAULTS))
def test_every_setting_matches_transformers_and_the_faults_fail(derived, model_type, tmp_path):
    """bfloat16 and the family's settings (afmoe's dense layers, shared experts; rope types, biases, tied
    embeddings); afmoe's selection bias and routed scale dropped, bitnet's sub-norms dropped. Default-suite coverage
    of the same path: test_the_files_match_transformers_and_a_dropped_gate_sigmoid_fails."""
    rows = selfcheck_with_faults({model_type: derived[model_type]}, FAULTS, "NativeForCausalLM", tmp_path,
                                 keep=lambda label: label not in UNMET.get(model_type, ()))
    assert len(rows) > 3


# what a type's file does not meet yet: bitnet's bfloat16 prefill differs from transformers' by 1.36 against the
# run dtype's tolerance 1.09 (float32 within 1e-5; with hidden_act silu instead of its relu2 the bfloat16 check
# passes; its recipe passes the per-step precision verdict at 1 and 2 ranks, test_native_models.py)
UNMET = {"bitnet": ("the checkpoint's config in bfloat16",)}
