"""Tensor parallel on CPU (gloo, torchrun): the vendored classes sharded by the model's own plan give
the single-process logits and greedy tokens; each rank holds 1/N of the sharded weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT

PROBE = Path(__file__).resolve().parent / "tp_probe.py"


def vendor_recipe(ckpt: Path, out: Path, name: str) -> Path:
    """Vendor + render a recipe in-process (no trial run): the same nodes `migrator run` uses."""
    from agent.nodes import node_render, node_vendor

    state = {"model_dir": str(ckpt), "recipe_dir": str(out / name), "model_name": name,
             "model_source": str(ckpt), "device": "cpu", "max_new_tokens": 6}
    state.update(node_vendor(state))
    node_render(state)
    return out / name


def run_probe(recipe: Path, out: Path, tp: int, timeout: int = 600) -> list[dict]:
    """tp=1: one plain process; tp>1: torchrun with tp ranks. Returns each rank's record."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable] if tp == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}"]
    proc = subprocess.run([*launcher, str(PROBE), str(recipe), str(out), str(tp)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=recipe)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(tp)]


def assert_tp_parity(tiny_checkpoints, tmp_path, model_type: str, tp: int = 2, **overrides):
    import torch

    recipe = vendor_recipe(tiny_checkpoints(model_type, **overrides), tmp_path, f"tp_{model_type}")
    (single,) = run_probe(recipe, tmp_path / "tp1", 1)
    ranks = run_probe(recipe, tmp_path / f"tp{tp}", tp)
    reference = torch.tensor(single["logits"])
    for record in ranks:
        delta = (torch.tensor(record["logits"]) - reference).abs().max().item()
        assert delta < 1e-5, (model_type, record["rank"], delta)
        assert record["tokens"] == single["tokens"]
        # Per rank: 1/tp of each sharded weight (+ the replicated rest); the sharded part is most of the model.
        full, local = single["param_bytes"], record["param_bytes"]
        assert local.keys() == full.keys()
        sharded = [name for name in full if local[name] < full[name]]
        sharded_bytes = sum(full[name] for name in sharded)
        assert sharded_bytes > 0.5 * single["held_bytes"], (model_type, sharded)
        for name in sharded:
            assert abs(local[name] * tp - full[name]) <= 0.02 * full[name], (name, local[name], full[name])
        assert record["held_bytes"] == sum(local.values()) < single["held_bytes"]
        assert abs(record["held_bytes"] - (single["held_bytes"] - sharded_bytes * (1 - 1 / tp))) < 0.01 * single["held_bytes"]
        print(f"TP {model_type} tp={tp} rank {record['rank']}: max|dlogits| {delta:.2e}, holds {record['held_bytes']} "
              f"of {single['held_bytes']} bytes ({len(sharded)} sharded weights)")
    return single, ranks


@pytest.mark.parametrize("model_type", [
    "llama",
    "qwen3_moe",
    pytest.param("qwen3", marks=pytest.mark.slow),
    pytest.param("mistral", marks=pytest.mark.slow),
    pytest.param("gemma2", marks=pytest.mark.slow),
    pytest.param("mixtral", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", marks=pytest.mark.slow),
])
def test_tp2_matches_single_process_logits_and_greedy_tokens(model_type, tiny_checkpoints, tmp_path):
    assert_tp_parity(tiny_checkpoints, tmp_path, model_type)


@pytest.mark.slow
def test_tp4_matches_single_process(tiny_checkpoints, tmp_path):
    assert_tp_parity(tiny_checkpoints, tmp_path, "llama", tp=4, num_key_value_heads=4)
