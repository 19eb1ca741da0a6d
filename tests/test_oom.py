"""OOM path: a real out-of-memory under a memory cap ends in a per-rank estimate, exit code 6 and a
runnable multi-card YAML; that YAML then runs tensor parallel on 2 ranks under the same cap."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys

import pytest

from conftest import REPO_ROOT


def _texts(log) -> list[str]:
    return re.findall(r"Request 0: outputs: (.*)", log.read_text())


@pytest.mark.slow
def test_weights_over_the_capped_card_oom_then_run_on_two_capped_ranks(tiny_checkpoints, tmp_path):
    # ~1.07 GB of fp32 weights; every process (the migrator, infer.sh, each torchrun rank) is capped
    # at 1250 MiB of data (RLIMIT_DATA: allocations beyond it fail with ENOMEM, as on a full
    # device). One process cannot hold the weights; each of two tensor-parallel ranks holds half.
    ckpt = tiny_checkpoints("llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                            num_attention_heads=8, num_key_value_heads=8, head_dim=128)
    cap = 1250 * 2**20

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "run", str(ckpt), "--name", "big", "--output-dir",
                           str(tmp_path), "--device", "cpu", "--max-new-tokens", "8", "--json"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=900, preexec_fn=limit_memory, env=env)
    assert proc.returncode == 6, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["status"] == "oom"
    recipe = tmp_path / "big"
    output = "".join(p.read_text() for p in (recipe / ".migrator" / "runs").glob("run_*/output.txt"))
    assert re.search(r"(?i)allocate memory|MemoryError|out of memory", output), output[-3000:]
    report = json.loads((recipe / "migration_report.json").read_text())
    memory = report["memory"]
    assert memory["device_bytes"] == cap
    assert 1.0e9 < memory["weights_bytes"] < 1.1e9           # read from the safetensors header
    # Per rank for tp = 1, 2, 4, 8, 16: one card is too small, two are the smallest that fit.
    per_rank = {int(tp): row for tp, row in memory["per_rank"].items()}
    assert sorted(per_rank) == [1, 2, 4, 8, 16]
    assert per_rank[1]["needed_bytes"] == memory["needed_bytes"] > cap and not per_rank[1]["fits"]
    assert per_rank[2]["fits"] and per_rank[2]["weights_bytes"] < 0.51 * memory["weights_bytes"]
    assert memory["cards_needed"] == memory["suggested_world_size"] == 2
    # The single-card recipe is kept; the 2-card YAML is written and the message says how to run it.
    assert "world_size: 1" in (recipe / "config" / "big_1card_eager.yaml").read_text()
    two_cards = recipe / "config" / "big_2card_eager.yaml"
    assert memory["multicard_yaml"] == "config/big_2card_eager.yaml"
    assert "YAML_FILE=config/big_2card_eager.yaml bash infer.sh" in summary["message"]
    assert "YAML_FILE=config/big_2card_eager.yaml bash infer.sh" in (recipe / "README.md").read_text()

    # The single card's text, uncapped, then the 2-card YAML under the cap: same text on rank 0.
    run_env = {**env, "PYTHON": sys.executable}
    single = subprocess.run(["bash", "infer.sh"], cwd=recipe, capture_output=True, text=True, timeout=600,
                            env={**run_env, "RES_PATH": str(tmp_path / "single")})
    assert single.returncode == 0, single.stderr[-3000:]
    proc = subprocess.run(["bash", "infer.sh"], cwd=recipe, capture_output=True, text=True, timeout=600,
                          preexec_fn=limit_memory, env={**run_env, "RES_PATH": str(tmp_path / "tp2"),
                                                        "YAML_FILE": "config/big_2card_eager.yaml"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert _texts(tmp_path / "tp2" / "log_0.log") == _texts(tmp_path / "single" / "log_0.log")
    for rank in (0, 1):
        log = (tmp_path / "tp2" / f"log_{rank}.log").read_text()
        held_mb = float(re.search(r"loaded \w+ \(([\d.]+) MB, float32, tensor parallel rank", log).group(1))
        assert held_mb * 1e6 < 0.51 * memory["weights_bytes"]
    assert "world_size: 2" in two_cards.read_text()
