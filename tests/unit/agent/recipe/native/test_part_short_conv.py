"""The gated short convolution in the attention's place (agent/recipe/native/parts/short_conv.py, its code
parts/code/short_conv.py: lfm2's conv layers) against transformers' Lfm2ShortConv as the executor drives it
(tests/support/short_conv_layer_check.py): a packed prefill of prompts of unequal length, one shorter than the conv's
history, then decode steps, each request's conv state in its block of the Mamba cache beside a NaN block no request
owns. A decode that forgets the conv state, B and C read the other way round, or the taps read back to front fail.
lfm2's whole file (conv layers beside q/k-normed attention, its MLP's w1 / w3 / w2 read by role at a block-adjusted
width, its norms' epsilon under norm_eps) is held to transformers in the slow cases."""

from __future__ import annotations

import pytest

from locations import REPO_ROOT

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"


def run(jobs):
    import gdn_layer_check
    import short_conv_layer_check

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    return gdn_layer_check.run(jobs, SNAPSHOT, short_conv_layer_check.__file__)


def test_the_layer_matches_transformers_across_prefill_and_decode_and_lost_state_fails():
    """float32 and bfloat16 across prefill and decode; a decode from a zero conv state fails at its first step (the
    slow table holds the other faults)."""
    good_fp32, good_bf16, lost = run([{}, {"dtype": "bfloat16"}, {"fault": "conv_state"}])
    assert good_fp32["ok"] and good_fp32["max_rel"] < 1e-4, good_fp32
    assert good_bf16["ok"], good_bf16
    assert not lost["ok"] and lost["step"] == "decode step 1", lost


@pytest.mark.slow
def test_every_fault_and_the_conv_bias():
    """Covered by default: test_the_layer_matches_transformers_across_prefill_and_decode_and_lost_state_fails. B and
    C swapped and the taps reversed fail at the prefill, the lost state in bfloat16 at decode; conv_bias's biases
    load and match."""
    jobs = [{"conv_bias": True}, {"conv_bias": True, "dtype": "bfloat16"}, {"fault": "gates"}, {"fault": "taps"},
            {"dtype": "bfloat16", "fault": "conv_state"}]
    biased, biased_bf16, gates, taps, lost = run(jobs)
    assert biased["ok"] and biased["max_rel"] < 1e-4 and biased_bf16["ok"], (biased, biased_bf16)
    assert [(r["ok"], r["step"]) for r in (gates, taps, lost)] == \
        [(False, "prefill"), (False, "prefill"), (False, "decode step 1")], (gates, taps, lost)


def _lfm2_config():
    from agent.testing.checkpoint_shapes import checkpoint_config

    return checkpoint_config("lfm2")[0]


@pytest.mark.slow
def test_lfm2_is_read_as_conv_layers_beside_attention_with_its_own_mlp_width_and_eps():
    """Covered by default (the conv layer's path): test_the_layer_matches_transformers_across_prefill_and_decode_and_
    lost_state_fails. The conv layers are the linear_attention slot's (bound by layer_types' "conv", stored under
    conv.*); the MLP's w1 / w3 / w2 are gate / up / down by what they compute, silu read from the module (no config
    key names it), its width block-adjusted; the norms' epsilon is config.norm_eps."""
    from agent.recipe.native.compose import derive

    composition = derive(_lfm2_config())
    assert composition.parts["linear_attention"] == "short_conv" and composition.parts["mlp"] == "gated_mlp"
    options = composition.options
    assert options["LINEAR_LAYER_TYPE"] == "conv" and options["NORM_EPS"] == "norm_eps"
    assert options["FF_AUTO_ADJUST"] is True and options["SWIGLU"] is True
    renames = dict(options["CHECKPOINT_RENAMES"])
    assert renames["^model\\.layers\\.(\\d+)\\.conv\\."] == "model.layers.\\1.linear_attn."
    assert [renames[f"\\.mlp\\.{w}\\."] for w in ("w1", "w3", "w2")] == [".mlp.gate_proj.", ".mlp.up_proj.",
                                                                          ".mlp.down_proj."]


@pytest.mark.slow
def test_the_mlp_roles_follow_what_it_computes_and_another_activation_is_refused():
    """Covered by default: test_the_layer_matches_transformers_across_prefill_and_decode_and_lost_state_fails. An MLP
    computing silu(w3) * w1 is read with w3 as its gate; one computing gelu where no config key names an activation
    is refused in one line (the file would have to fix it in code)."""
    import torch.nn.functional as F
    from transformers.models.lfm2 import modeling_lfm2

    from agent.recipe.native.compose import derive
    from agent.recipe.native.not_native import NotNative

    saved = modeling_lfm2.Lfm2MLP.forward
    try:
        modeling_lfm2.Lfm2MLP.forward = lambda self, x: self.w2(F.silu(self.w3(x)) * self.w1(x))
        renames = dict(derive(_lfm2_config()).options["CHECKPOINT_RENAMES"])
        assert renames["\\.mlp\\.w3\\."] == ".mlp.gate_proj." and renames["\\.mlp\\.w1\\."] == ".mlp.up_proj."
        modeling_lfm2.Lfm2MLP.forward = lambda self, x: self.w2(F.gelu(self.w1(x)) * self.w3(x))
        with pytest.raises(NotNative) as refused:
            derive(_lfm2_config())
    finally:
        modeling_lfm2.Lfm2MLP.forward = saved
    assert refused.value.kind == "mlp" and "computes gelu" in refused.value.reason
    assert "\n" not in refused.value.reason


@pytest.mark.slow
def test_lfm2_file_matches_transformers_in_both_dtypes_and_a_lost_conv_state_fails(tmp_path):
    """Covered by default: test_the_layer_matches_transformers_across_prefill_and_decode_and_lost_state_fails.
    lfm2's file derived from its checkpoint shape, rendered, held to transformers in float32 and bfloat16 (packed
    prefill, decode steps, Mamba state blocks NaN before the prefill); the conv state forgotten at decode fails."""
    from agent.recipe.native.decide import render_native, selfcheck, selfcheck_jobs

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    from agent.recipe.native.compose import derive

    config = _lfm2_config()
    composition = derive(config)
    ctx = {"model_name": "lfm2", "framework_class": "NativeForCausalLM", "display_name": "lfm2", "model_class": "X"}
    text = render_native(ctx, composition)
    fault = ("self.conv_state.index_select(0, blocks)", "torch.zeros_like(self.conv_state.index_select(0, blocks))")
    assert text.count(fault[0]) == 1
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text(text)
    bad.write_text(text.replace(*fault))
    labelled = selfcheck_jobs(config, composition.checked_variants, str(good), ctx["framework_class"])[:2]
    jobs = [job for _, job in labelled] + [{"config": config, "file": str(bad), "class_name": ctx["framework_class"]}]
    results = selfcheck(jobs, SNAPSHOT)
    assert labelled[1][1]["dtype"] == "bfloat16", labelled
    assert all(r["ok"] for r in results[:2]), [(label, r["reason"]) for (label, _), r in zip(labelled, results)]
    assert results[0]["max_rel"] < 1e-4
    assert not results[2]["ok"] and "decode" in results[2]["reason"], results[2]


@pytest.mark.slow
def test_lfm3_reads_as_a_sandwich_conv_hybrid_with_its_attention_gate():
    """Covered by default: test_the_layer_matches_transformers_across_prefill_and_decode_and_lost_state_fails. lfm3's
    layers (operator_norm, post_operator_norm, ffn_norm, post_ffn_norm around a conv or an attention) are read as
    the sandwich layer by where they are called; its attention's per-head sigmoid gate (g_proj) is read by the
    output-gate part (parts/attention_gate.py). It derives with or without the gate (its rope per attention type:
    test_part_rotary_typed.py)."""
    from transformers import AutoConfig

    from agent.recipe.native.compose import derive

    gated = derive(AutoConfig.for_model("lfm3").to_dict())
    assert gated.parts["block"] == "sandwich" and gated.parts["linear_attention"] == "short_conv"
    assert (gated.options["GATE_PROJ"], gated.options["GATE_PER_HEAD"], gated.options["GATE_SOFTPLUS"]) == \
        ("g_proj", True, False)
    composition = derive(AutoConfig.for_model("lfm3", use_attention_gate=False).to_dict())
    assert composition.parts["block"] == "sandwich" and composition.parts["linear_attention"] == "short_conv"
    renames = dict(composition.options["CHECKPOINT_RENAMES"])
    assert renames["^model\\.layers\\.(\\d+)\\.post_operator_norm\\."] == "model.layers.\\1.post_attention_layernorm."
    assert renames["^model\\.layers\\.(\\d+)\\.ffn_norm\\."] == "model.layers.\\1.pre_feedforward_layernorm."
