"""Prefill context parallel (parallel_config.cp_size) of a native dense recipe, end to end: a tiny qwen3 migrated
natively into a copy of the cann-recipes-infer snapshot, run by upstream's launcher under the stand-in through
`migrator run RECIPE --standin --yaml Y --world-size 2` with cp_size 2 (upstream's rule: cp_size == world_size,
attn_tp_size 1), on a batch of two prompts of unequal length: the executor pads each to 4 zigzag segments, each
rank computes two of them over the keys and values gathered from both (agent/recipe/native/parts/code/
context_parallel.py), keeps the cache of the request it decodes, and each step is held to transformers by the
precision check. A segment attending over the wrong key range (the later segment given the earlier one's) fails.

All `slow` (upstream's launcher at 2 ranks); the default suite covers the same arithmetic in process:
tests/unit/agent/recipe/native/test_context_parallel.py (upstream's own cp_metadata, both halves' key ranges
against a causal attention of the whole prompt, and the same fault)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from agent.measure import reference as upstream
from framework_recipes import INSTALLED, MAX_NEW_TOKENS, PROMPTS
from migrator_cli import run_cli
from upstream_checkout import copy_checkout

MODEL_TYPE = "qwen3"
# the later segment's key range in the generated attention: the fault gives it the earlier segment's
LATER_HALF = "(query[cp.local_prev_token_num:], cp.actual_seq_q_next, cp.kv_len_next)"


@pytest.fixture(scope="module")
def cp_recipe(tmp_path_factory):
    from agent.workflow.run import run_migration

    root = tmp_path_factory.mktemp("context_parallel")
    checkout = copy_checkout(root)
    checkpoint = upstream.tiny_checkpoint(MODEL_TYPE, root / "ckpt")
    run_migration({"target": str(checkpoint), "output_dir": str(checkout / "models"), "name": "tiny_cp",
                   "device": "cpu", "max_new_tokens": MAX_NEW_TOKENS, "max_rounds": 0, "world_size": 1,
                   "recipe_target": "framework", **INSTALLED}, stop_after="render")
    recipe = checkout / "models" / "tiny_cp"
    assert not (recipe / "models" / "modeling_tiny_cp_framework.py").exists()       # native, not the adapter
    prompts = root / "prompts"
    prompts.mkdir()
    (prompts / "default_prompt.json").write_text(json.dumps({"text": PROMPTS}))
    return {"recipe": recipe, "checkpoint": checkpoint, "prompts": prompts}


def run_cp(cp_recipe, name: str, cp_size: int = 2):
    """The recipe's YAML with cp_size at 2 ranks on the two prompts (batch 2), run per step: (proc, baseline)."""
    recipe = cp_recipe["recipe"]
    data = yaml.safe_load((recipe / "config" / "tiny_cp.yaml").read_text())
    data["model_config"]["model_path"] = str(cp_recipe["checkpoint"])
    data["data_config"]["dataset_path"] = str(cp_recipe["prompts"])
    data["scheduler_config"]["batch_size"] = 2
    data["parallel_config"].update(world_size=2, attn_tp_size=1, moe_tp_size=1, embed_tp_size=1, lmhead_tp_size=1,
                                   cp_size=cp_size)
    (recipe / "config" / name).write_text(yaml.safe_dump(data, sort_keys=False))
    proc = run_cli("run", str(recipe), "--standin", "--yaml", name, "--world-size", "2", "--max-rounds", "0",
                   "--json", timeout=1800)
    summary = json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1]) if "{" in proc.stdout else {}
    baseline = json.loads(Path(summary["baseline_path"]).read_text()) if summary.get("baseline_path") else {}
    return proc, summary, baseline


@pytest.mark.slow
def test_context_parallel_two_ranks_passes_each_step(cp_recipe):
    """cp_size 2 at 2 ranks: each rank prefills two of every prompt's four segments, decodes its own request (the
    executor's request_cp_rank: request i on rank i % 2) from the cache it kept, and every step of both requests
    passes against transformers."""
    proc, summary, baseline = run_cp(cp_recipe, "cp2.yaml")
    assert proc.returncode == 0 and summary.get("status") == "ok", (proc.stdout + proc.stderr)[-3000:]
    assert baseline["standin"]["world_size"] == 2 and baseline["standin"]["unsupported"] == [], baseline["standin"]
    parity = baseline["verification"]["parity"]
    assert parity["checked"] and parity["ok"] and parity["ranks"] == 2, parity
    per_request = parity["per_request"]
    assert sorted(r["rank"] for r in per_request) == [0, 1], per_request
    assert all(r["tokens"] >= MAX_NEW_TOKENS for r in per_request), per_request


@pytest.mark.slow
def test_a_segment_attending_over_the_wrong_keys_fails_the_check(cp_recipe):
    """The later segment attends over the earlier segment's key range (kv_len_prev): the per-step check fails at
    the prefill."""
    modeling = cp_recipe["recipe"] / "models" / "modeling_tiny_cp.py"
    correct = modeling.read_text()
    assert correct.count(LATER_HALF) == 1
    modeling.write_text(correct.replace(LATER_HALF, LATER_HALF.replace("kv_len_next", "kv_len_prev")))
    try:
        proc, summary, baseline = run_cp(cp_recipe, "cp2_wrong_keys.yaml")
    finally:
        modeling.write_text(correct)
    parity = baseline.get("verification", {}).get("parity", {})
    assert proc.returncode == 1 and parity.get("ok") is False, (proc.stdout + proc.stderr)[-3000:]
    assert parity["first_failing_step"] == "the prefill", parity
