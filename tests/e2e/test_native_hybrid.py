"""A hybrid linear-attention model end to end: a tiny qwen3_next (three Gated DeltaNet layers and one gated full
attention layer, sparse MoE with a gated shared expert) migrated natively into a copy of the cann-recipes-infer
snapshot, run by upstream's launcher under the stand-in through `migrator run RECIPE --standin` on a batch of two
prompts of unequal length: the executor allocates the linear layers' conv and recurrent states as Mamba cache
entries (one block per request), the prefill runs npu_chunk_gated_delta_rule and the decode
npu_recurrent_gated_delta_rule, and each step is held to transformers by the precision check. Measured (the YAML
as rendered, npugraph_ex: the decode compiled): 18 steps of 2 requests pass, the closest a prefill at 0.664 of
its tolerance; npu_chunk_gated_delta_rule called 6 times, npu_recurrent_gated_delta_rule 27 (4 min 28 s here).

Slow (upstream's launcher, a migration): the default suite's case of the same file on the executor's contract
is tests/unit/agent/recipe/native/test_part_gated_delta_net.py (test_the_hybrid_file_matches_transformers_and_faults_fail:
packed prefill then decode on the paged and Mamba caches, in float32 and bfloat16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from agent.measure import reference as upstream
from framework_recipes import INSTALLED, MAX_NEW_TOKENS, PROMPTS
from migrator_cli import run_cli
from upstream_checkout import copy_checkout

GDN = ("npu_chunk_gated_delta_rule", "npu_recurrent_gated_delta_rule")


@pytest.mark.slow
def test_qwen3_next_runs_natively_through_upstreams_launcher_and_passes_each_step(tmp_path):
    from agent.workflow.run import run_migration

    checkout = copy_checkout(tmp_path)
    checkpoint = upstream.tiny_checkpoint("qwen3_next", tmp_path / "ckpt", num_hidden_layers=4)
    run_migration({"target": str(checkpoint), "output_dir": str(checkout / "models"), "name": "tiny_hybrid",
                   "device": "cpu", "max_new_tokens": MAX_NEW_TOKENS, "max_rounds": 0, "world_size": 1,
                   "recipe_target": "framework", **INSTALLED}, stop_after="render")
    recipe = checkout / "models" / "tiny_hybrid"
    assert not (recipe / "models" / "modeling_tiny_hybrid_framework.py").exists()       # native, not the adapter
    modeling = next((recipe / "models").glob("modeling_*.py")).read_text()
    assert "MambaCacheEntry(" in modeling and "torch_npu.npu_chunk_gated_delta_rule(" in modeling
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "default_prompt.json").write_text(json.dumps({"text": PROMPTS}))
    data = yaml.safe_load((recipe / "config" / "tiny_hybrid.yaml").read_text())
    data["model_config"]["model_path"] = str(checkpoint)
    data["data_config"]["dataset_path"] = str(prompts)
    data["scheduler_config"]["batch_size"] = 2
    (recipe / "config" / "batch2.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    proc = run_cli("run", str(recipe), "--standin", "--yaml", "batch2.yaml", "--world-size", "1", "--max-rounds", "0",
                   "--json", timeout=1800)
    summary = json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1]) if "{" in proc.stdout else {}
    assert proc.returncode == 0 and summary.get("status") == "ok", (proc.stdout + proc.stderr)[-3000:]
    baseline = json.loads(Path(summary["baseline_path"]).read_text())
    standin = baseline["standin"]
    assert standin["unsupported"] == [], standin
    kernels = standin["reference_kernels"]
    assert all(kernels.get(op, 0) > 0 for op in GDN), kernels
    parity = baseline["verification"]["parity"]
    assert parity["checked"] and parity["ok"] and parity["decode_steps_checked"] > 0, parity
    assert len({r["prompt_tokens"] for r in parity["per_request"]}) == 2, parity["per_request"]  # unequal prompts
    print(f"qwen3_next native under the stand-in: {', '.join(f'{op} {kernels[op]}' for op in GDN)}; "
          f"{parity['steps_checked']} steps, closest {parity['closest']}")
