"""The Mamba1 mixer's code (agent/recipe/native/parts/code/linear_attention_mamba1.py: jamba's mamba layers, mamba's
and falcon_mamba's mixers) against transformers' own JambaMambaMixer / MambaMixer / FalconMambaMixer on a tiny config,
as the executor drives it (tests/support/mamba1_layer_check.py): a packed prefill of prompts of unequal length (one
shorter than the conv's history), then decode steps, each request's conv and ssm state in its block of the Mamba
cache (every block NaN before the prefill, a NaN block no request owns at each step). The scan is plain torch in
float32; a bfloat16 run is held by the precision verdict's rule. A decode that forgets either state, a scan without
its D skip, or dt / B / C left un-normed fails. The whole jamba file: test_part_mamba2_hybrids.py."""

from __future__ import annotations

import pytest

from locations import REPO_ROOT

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"
FAMILIES = ("jamba", "mamba", "falcon_mamba")


def run(jobs):
    import gdn_layer_check

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    return gdn_layer_check.run(jobs, SNAPSHOT, REPO_ROOT / "tests" / "support" / "mamba1_layer_check.py")


@pytest.mark.slow
def test_jambas_mixer_matches_transformers_and_a_decode_that_forgets_the_conv_state_fails():
    """jamba's mixer (weighted dt / B / C norms) in float32 within 1e-4 of transformers' at the prefill and every
    decode step; a decode that forgets the conv history fails at its first step. Default case covering this path:
    the whole jamba file, test_part_mamba2_hybrids.py::test_bamba_file_matches_transformers_and_a_dropped_d_skip_fails
    (jamba's smallest hybrid beside bamba's in one self-check; its slow table holds jamba's state faults)."""
    good, fault = run([{"family": "jamba"}, {"family": "jamba", "fault": "conv_state"}])
    assert good["ok"] and good["max_rel"] < 1e-4, good
    assert not fault["ok"] and fault["step"] == "decode step 1", fault


@pytest.mark.slow
def test_each_family_matches_transformers_in_both_dtypes_and_every_fault_fails_where_it_shows():
    """jamba (weighted dt / B / C norms), mamba (none) and falcon_mamba (weightless) in float32 within 1e-4 and in
    bfloat16 at the prefill and every decode step; the conv or ssm state lost at decode fails at its first step, the
    D skip dropped and the dt / B / C norms skipped fail at the prefill. Default case covering this path:
    test_jambas_mixer_matches_transformers_and_a_decode_that_forgets_the_conv_state_fails."""
    goods = [{"family": f, "dtype": d} for f in FAMILIES for d in ("float32", "bfloat16")]
    faults = [{"family": "jamba", "fault": "conv_state"}, {"family": "mamba", "fault": "ssm_state"},
              {"family": "falcon_mamba", "dtype": "bfloat16", "fault": "ssm_state"},
              {"family": "mamba", "fault": "skip"}, {"family": "jamba", "fault": "dt_norm"},
              {"family": "falcon_mamba", "fault": "dt_norm"}]
    results = run(goods + faults)
    assert all(r["ok"] for r in results[:len(goods)]), list(zip(goods, results))
    assert all(r["max_rel"] < 1e-4 for g, r in zip(goods, results) if g["dtype"] == "float32"), results
    failed = results[len(goods):]
    assert not any(r["ok"] for r in failed), list(zip(faults, failed))
    assert [r["step"] for r in failed] == ["decode step 1"] * 3 + ["prefill"] * 3, list(zip(faults, failed))

