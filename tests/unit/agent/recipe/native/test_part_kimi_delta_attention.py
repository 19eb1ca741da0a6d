"""The Kimi Delta Attention layer's code (agent/recipe/native/parts/code/linear_attention_kda.py: kimi_linear's and
bailing_hybrid's linear_attention layers) against transformers' own layer on a tiny config, as the executor drives it
(tests/support/kda_layer_check.py): a packed prefill of prompts of unequal length, then decode steps from each
request's cached conv and recurrent state; the decay taken per head instead of per key channel fails, as does a
decode from a zero recurrent state. And the part read from each type's code (its probe holds the layer's arithmetic
to the file's formula)."""

from __future__ import annotations

import pytest

from locations import REPO_ROOT

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"


def run(jobs):
    import gdn_layer_check

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    return gdn_layer_check.run(jobs, SNAPSHOT, script=REPO_ROOT / "tests" / "support" / "kda_layer_check.py")


def test_the_layer_matches_transformers_across_prefill_and_decode_and_faults_fail():
    """kimi_linear (low-rank gates) and bailing_hybrid (full gates, the bounded forget gate) in float32; the decay
    per head and a lost recurrent state fail (the slow test: bfloat16, the unbounded gate, a lost conv state)."""
    jobs = [{"model_type": "kimi_linear"}, {"model_type": "bailing_hybrid"},
            {"model_type": "kimi_linear", "fault": "per_head_decay"},
            {"model_type": "bailing_hybrid", "fault": "recurrent_state"}]
    kimi, bailing, per_head, lost = run(jobs)
    assert kimi["ok"] and kimi["max_rel"] < 1e-4, kimi
    assert bailing["ok"] and bailing["max_rel"] < 1e-4, bailing
    assert not per_head["ok"] and per_head["step"] == "prefill", per_head
    assert not lost["ok"] and lost["step"] == "decode step 1", lost


@pytest.mark.slow
def test_bfloat16_the_unbounded_gate_and_a_lost_conv_state():
    """Covered by default in float32 by test_the_layer_matches_transformers_across_prefill_and_decode_and_faults_fail."""
    goods = [{"model_type": "kimi_linear", "dtype": "bfloat16"}, {"model_type": "bailing_hybrid", "dtype": "bfloat16"},
             {"model_type": "bailing_hybrid", "config": {"kda_safe_gate": False}}]
    results = run(goods + [{"model_type": "kimi_linear", "fault": "conv_state"}])
    assert all(r["ok"] for r in results[:3]), list(zip(goods, results))
    assert not results[3]["ok"] and results[3]["step"] == "decode step 1", results[3]


@pytest.mark.parametrize("model_type, forget, output, safe", [
    ("kimi_linear", "low_rank", "low_rank", None),
    # slow: the kimi_linear case covers the probe's path
    pytest.param("bailing_hybrid", "full", "full", "kda_safe_gate", marks=pytest.mark.slow)])
def test_the_part_is_read_from_the_code(model_type, forget, output, safe):
    """The probe finds the layer's gates (and holds its arithmetic to the file's formula) on the type's code."""
    from transformers import AutoConfig

    from agent.recipe.native.parts.linear_attention_kda import _probe
    from agent.recipe.native.parts.probe import Probe

    probe = Probe(AutoConfig.for_model(model_type).to_dict())
    match = _probe(probe, {})
    assert match.options["LINEAR_ATTN_NAME"] == "self_attn"
    assert (match.options["KDA_FORGET_GATE"], match.options["KDA_OUTPUT_GATE"], match.options["KDA_SAFE_GATE_KEY"]) \
        == (forget, output, safe)
    assert match.options["CONV_SHARDS"]
