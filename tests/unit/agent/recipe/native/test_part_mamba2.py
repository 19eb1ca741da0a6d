"""The Mamba2 mixer's code (agent/recipe/native/parts/code/linear_attention_mamba2.py: bamba's mamba layers) against
transformers' own BambaMixer on a tiny config, as the executor drives it (tests/support/mamba2_layer_check.py): a
packed prefill of prompts of unequal length (one shorter than the conv's history, one longer than transformers' SSD
chunk), then decode steps, each request's conv and ssm state in its block of the Mamba cache (every block NaN before
the prefill, a NaN block no request owns at each step). The recurrence is plain torch in float32 (upstream's models
use no NPU op for it); a bfloat16 run is held by the precision verdict's rule. A decode that forgets either state,
or a recurrence without its D skip, fails."""

from __future__ import annotations

import pytest

from locations import REPO_ROOT

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"


def run(jobs):
    import gdn_layer_check

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    return gdn_layer_check.run(jobs, SNAPSHOT, REPO_ROOT / "tests" / "support" / "mamba2_layer_check.py")


@pytest.mark.slow
def test_the_mixer_matches_transformers_across_prefill_and_decode_and_lost_conv_state_fails():
    """float32 and bfloat16 (n_groups 2 where the installed transformers norms per group) held at the prefill and
    every decode step; a decode that forgets the conv history fails at its first step (the slow table holds the
    other faults). Default case covering this path: the whole generated file,
    test_part_mamba2_hybrids.py::test_bamba_file_matches_transformers_and_a_dropped_d_skip_fails."""
    good_fp32, good_bf16, fault = run([{}, {"dtype": "bfloat16"}, {"fault": "conv_state"}])
    assert good_fp32["ok"] and good_fp32["max_rel"] < 1e-4, good_fp32
    assert good_bf16["ok"], good_bf16
    assert not fault["ok"] and fault["step"] == "decode step 1", fault


@pytest.mark.slow
def test_every_fault_fails_where_it_shows():
    """One group and several (where the installed transformers groups its norm), both dtypes; the ssm state lost at
    decode (float32 and bfloat16) and the D skip dropped fail where they show. Default case covering this path: the
    test above."""
    goods = [{"groups": 1}, {"groups": 1, "dtype": "bfloat16"}, {"dtype": "bfloat16"}]
    faults = [{"fault": "ssm_state"}, {"dtype": "bfloat16", "fault": "ssm_state"}, {"fault": "skip"},
              {"groups": 1, "dtype": "bfloat16", "fault": "conv_state"}]
    results = run(goods + faults)
    assert all(r["ok"] for r in results[:len(goods)]), list(zip(goods, results))
    steps = [r["step"] for r in results[len(goods):]]
    assert not any(r["ok"] for r in results[len(goods):]), list(zip(faults, results[len(goods):]))
    assert steps == ["decode step 1", "decode step 1", "prefill", "decode step 1"], steps
