"""The Gated DeltaNet layer's code (agent/recipe/native/parts/code/linear_attention_gdn.py: qwen3_next's and qwen3_5's
linear_attention layers) against transformers' own layer on a tiny config, as the executor drives it
(tests/support/gdn_layer_check.py): a packed prefill of prompts of unequal length, one shorter than the conv's
history, then decode steps, each request's conv and recurrent state in its block of the Mamba cache beside a NaN
block no request owns. float32 runs the rule in plain torch (the NPU ops return bfloat16); bfloat16 runs
npu_chunk_gated_delta_rule and npu_recurrent_gated_delta_rule (the stand-in's references), held by the precision
verdict's rule. A decode that forgets either state, or a decay of the wrong sign, fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from locations import REPO_ROOT

SNAPSHOT = REPO_ROOT.parent / "shared" / "upstream" / "cann-recipes-infer"


def run(jobs):
    from npu_standin.environment import standin_env

    if not SNAPSHOT.is_dir():
        pytest.skip(f"no upstream snapshot at {SNAPSHOT}")
    env = standin_env("cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(SNAPSHOT), str(REPO_ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "support" / "gdn_layer_check.py"), json.dumps(jobs)],
                          env=env, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    line = next((l for l in done.stdout.splitlines() if l.startswith("CHECK ")), None)
    assert line is not None, done.stderr[-3000:]
    return json.loads(line[len("CHECK "):])


def test_the_layer_matches_transformers_across_prefill_and_decode_and_lost_state_fails():
    """qwen3_next in float32 and bfloat16; decode from a zero recurrent state fails (the slow table holds the rest)."""
    jobs = [{"model_type": "qwen3_next"}, {"model_type": "qwen3_next", "dtype": "bfloat16"},
            {"model_type": "qwen3_next", "dtype": "bfloat16", "fault": "recurrent_state"}]
    good_fp32, good_bf16, fault = run(jobs)
    assert good_fp32["ok"] and good_fp32["max_rel"] < 1e-4, good_fp32
    assert good_bf16["ok"], good_bf16
    assert not fault["ok"] and fault["step"] == "decode step 1", fault


@pytest.mark.slow
def test_both_layouts_in_both_dtypes_and_every_fault():
    """qwen3_5's separate projections beside qwen3_next's grouped ones; the conv history lost at decode, the
    recurrent state lost in float32, the decay's sign flipped: each fails where it shows."""
    goods = [{"model_type": t, "dtype": d} for t in ("qwen3_next", "qwen3_5_text") for d in ("float32", "bfloat16")]
    faults = [{"model_type": "qwen3_next", "fault": "conv_state"},
              {"model_type": "qwen3_5_text", "fault": "recurrent_state"},
              {"model_type": "qwen3_5_text", "dtype": "bfloat16", "fault": "decay"}]
    results = run(goods + faults)
    assert all(r["ok"] for r in results[:len(goods)]), list(zip(goods, results))
    steps = [r["step"] for r in results[len(goods):]]
    assert not any(r["ok"] for r in results[len(goods):]) and steps == ["decode step 1", "decode step 1", "prefill"], \
        list(zip(faults, results[len(goods):]))
