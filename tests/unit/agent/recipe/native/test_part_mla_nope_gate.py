"""Two options of the MLA part (agent/recipe/native/parts/mla.py, code parts/code/attention_mla.py) read from
transformers' attention modules: MLA without positions (kimi_linear: its model builds no rotary table, the rope dims
of the query and the shared key pass unrotated: MLA_NOPE) and an output gate of its own (bailing_hybrid's g_proj:
sigmoid per head times the attention's output before o_proj, parts/attention_gate.py's measure: GATE_PROJ).

Default: each option read from its type's module, and the probe's candidates told apart numerically (the unrotated
candidate far from kimi_linear's module once rotated, and from bailing_hybrid's rotating one; the ungated candidate
far from bailing_hybrid's). `-m slow`: both types' files held to transformers per step (float32, bfloat16, each
family setting) and a fault of each option — the query's rope dims permuted as a rope kernel would with an identity
table, the gate dropped — failing the same check."""

from __future__ import annotations

import pytest

EXPECTED = {
    "kimi_linear": {"MLA_NOPE": True, "Q_LORA": False, "YARN_MSCALE": False, "PROLOG": False, "GATE_PROJ": None},
    "bailing_hybrid": {"MLA_NOPE": False, "GATE_PROJ": "g_proj", "GATE_PER_HEAD": True, "GATE_SOFTPLUS": False},
}


@pytest.fixture(scope="module")
def probes():
    from transformers import AutoConfig

    from agent.recipe.native.parts.probe import Probe

    return {model_type: Probe(AutoConfig.for_model(model_type).to_dict()) for model_type in EXPECTED}


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_nope_and_gate_options_are_read_from_the_module(probes, model_type):
    from agent.recipe.native.parts.mla import MLA, mla_kernels, mla_match

    match = mla_match(MLA, probes[model_type])
    assert {key: match.options.get(key) for key in EXPECTED[model_type]} == EXPECTED[model_type]
    fused, unfused = mla_kernels(match)
    # no rope: no kernel that rotates (npu_kv_rmsnorm_rope_cache_v2 and the prolog always do)
    nope = model_type == "kimi_linear"
    assert ("npu_kv_rmsnorm_rope_cache_v2" in " ".join(fused)) is not nope
    assert any(line.startswith("no rope") for line in unfused) is nope
    assert any(line.startswith("output gate: sigmoid of its own projection per head") for line in unfused) is not nope


def test_the_probe_tells_nope_and_the_gate_apart(probes):
    """Every candidate but the module's own is far from its output: bailing_hybrid's (rotated, gated) and
    kimi_linear's (unrotated: a rotary table of the default base, either rope form, is far from it)."""
    import torch

    from agent.recipe.native.parts import mla

    gate = {"GATE_PROJ": "g_proj", "GATE_SOFTPLUS": False, "GATE_PER_HEAD": True}
    own = {"bailing_hybrid": ("interleave", True), "kimi_linear": (mla.NOPE_FORM, False)}
    for model_type, probe in probes.items():
        attention, config = _attention(probe), probe.config
        x = torch.randn(mla.PROBE_TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(3))
        cos, sin = mla.rope_table(config, torch.arange(mla.PROBE_TOKENS))
        scale = mla.softmax_scale(config, "qk_head_dim")
        with torch.no_grad():
            got = mla._module_output(attention, probe.model, x)
            errors = {(form, gated): float((got - mla.candidate(attention, config, x, cos, sin, form, scale,
                                                                gate if gated else None)).abs().max() / got.abs().max())
                      for form in (*mla.ROPE_FORMS, mla.NOPE_FORM) for gated in (True, False)
                      if gated is False or hasattr(attention, "g_proj")}
        assert errors[own[model_type]] < 1e-5, (model_type, errors)
        assert all(err > 1e-3 for key, err in errors.items() if key != own[model_type]), (model_type, errors)


def _attention(probe):
    return next(layer.self_attn for layer in probe.layers if hasattr(layer, "self_attn"))


# (correct text of the rendered file, its faulty replacement): each option broken
FAULTS = {
    # the query's rope dims de-interleaved, as npu_interleave_rope with an identity table would: the shared key not
    "kimi_linear": [("        q_rope = q_pe\n", "        q_rope = torch.cat((q_pe[..., ::2], q_pe[..., 1::2]), dim=-1)\n")],
    # the output gate dropped
    "bailing_hybrid": [("out = out.reshape(q_len, self.num_heads_per_rank, -1) * gate.view(q_len, self.num_heads_per_rank, -1)",
                        "out = out.reshape(q_len, self.num_heads_per_rank, -1)")],
}


@pytest.mark.slow
def test_both_files_match_transformers_and_each_fault_fails(tmp_path):
    """Slow (two hybrid models' derive and self-check, the Kimi Delta Attention layers token by token): covered by
    default by test_nope_and_gate_options_are_read_from_the_module and test_the_probe_tells_nope_and_the_gate_apart
    (the options' formulas) and test_part_kimi_delta_attention.py (the linear layers)."""
    from part_selfcheck import derive_types, selfcheck_with_faults

    derived = derive_types(FAULTS)
    assert derived["kimi_linear"][1].parts["position"] == "no_positions"
    selfcheck_with_faults(derived, FAULTS, "NativeForCausalLM", tmp_path)
