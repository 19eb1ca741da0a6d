"""OOM path: an out-of-memory run ends in a per-rank estimate, exit code 6 and a runnable
multi-card YAML; the smallest N that fits is written next to the kept single-card one."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys

import pytest

from locations import REPO_ROOT
from migrator_cli import run_cli


def _texts(log) -> list[str]:
    return re.findall(r"Request 0: outputs: (.*)", log.read_text())


@pytest.mark.slow  # a 400 MB model under a real memory cap; the simulated card below covers the OOM hand-off by default
def test_memory_capped_run_ends_in_the_oom_report(tiny_checkpoints, tmp_path):
    # ~400 MB of fp32 weights and a batch (64) whose activations (and KV cache: 1.6 GB) do not fit the cap.
    ckpt = tiny_checkpoints("llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=6,
                            num_attention_heads=8, num_key_value_heads=8, head_dim=128)
    proc = run_cli("run", str(ckpt), "--name", "big", "--output-dir", str(tmp_path), "--device", "cpu",
                   "--max-new-tokens", "8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    recipe = tmp_path / "big"
    yaml_file = next((recipe / "config").glob("*.yaml"))
    yaml_file.write_text(yaml_file.read_text().replace("batch_size: 1", "batch_size: 64"))
    cap = 1200 * 2**20

    def limit_memory():  # RLIMIT_DATA: allocations beyond it fail with ENOMEM, as on a full device
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))

    proc = subprocess.run([sys.executable, "-m", "agent.cli", "run", str(recipe), "--json"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600, preexec_fn=limit_memory)
    assert proc.returncode == 6, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["status"] == "oom"
    output = (recipe / ".migrator" / "runs").glob("run_*/output.txt")
    assert any("can't allocate memory" in p.read_text() or "MemoryError" in p.read_text() for p in output)
    report = json.loads((recipe / "migration_report.json").read_text())
    memory = report["memory"]
    assert memory["device_bytes"] == cap
    assert 390e6 < memory["weights_bytes"] < 420e6           # read from the safetensors header
    assert memory["needed_bytes"] > cap and memory["cards_needed"] >= 2
    # Per rank, tp = 2, 4, 8, 16: weights and the KV cache (8 KV heads) split; the smallest that fits is written.
    per_rank = {int(tp): row for tp, row in memory["per_rank"].items()}
    assert sorted(per_rank) == [1, 2, 4, 8, 16]
    cards = memory["cards_needed"]
    assert per_rank[cards]["fits"] and not per_rank[cards // 2]["fits"]
    assert per_rank[2]["kv_cache_bytes"] * 2 == memory["kv_cache_bytes"]
    assert f"world_size: {cards}" in summary["message"]
    assert f"YAML_FILE=config/big_{cards}card_eager.yaml bash infer.sh" in summary["message"]
    assert f"world_size: {cards}" in (recipe / "config" / f"big_{cards}card_eager.yaml").read_text()
    # The single-card recipe is kept as the basis for parallelisation.
    assert (recipe / "infer.sh").is_file() and "world_size: 1" in (recipe / "config" / "big_1card_eager.yaml").read_text()
    assert memory["batch_size"] == 64 and memory["kv_cache_bytes"] > cap


def test_simulated_card_too_small_for_the_weights_then_the_2card_yaml_runs_tensor_parallel(tiny_checkpoints, tmp_path):
    """The "card" is simulated (CPU only, for tests): MIGRATOR_DEVICE_MEMORY_BYTES, which the engine
    enforces on the weights each rank holds. ~67 MB of fp32 weights on a 50 MB card: one card
    runs out of memory, the migration writes the 2-card YAML, and that runs with the single card's text."""
    ckpt = tiny_checkpoints("llama", hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=8, head_dim=64)
    card = 50 * 10**6
    env = {"MIGRATOR_DEVICE_MEMORY_BYTES": str(card), "OMP_NUM_THREADS": "1"}
    proc = run_cli("run", str(ckpt), "--name", "big", "--output-dir", str(tmp_path), "--device", "cpu",
                   "--max-new-tokens", "8", "--json", env=env)
    assert proc.returncode == 6, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    recipe = tmp_path / "big"
    output = "".join(p.read_text() for p in (recipe / ".migrator" / "runs").glob("run_*/output.txt"))
    assert "CPU out of memory (simulated card of 50000000 bytes" in output
    memory = json.loads((recipe / "migration_report.json").read_text())["memory"]
    assert memory["device_bytes"] == card and memory["runtime_bytes"] == 0
    per_rank = {int(tp): row for tp, row in memory["per_rank"].items()}
    assert memory["weights_bytes"] > card and not per_rank[1]["fits"] and per_rank[2]["fits"]
    assert memory["cards_needed"] == 2 and memory["multicard_yaml"] == "config/big_2card_eager.yaml"
    command = "YAML_FILE=config/big_2card_eager.yaml bash infer.sh"
    assert command in summary["message"] and command in (recipe / "README.md").read_text()
    assert "world_size: 1" in (recipe / "config" / "big_1card_eager.yaml").read_text()   # kept

    run_env = {**os.environ, **env, "PYTHON": sys.executable,
               "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    single = subprocess.run(["bash", "infer.sh"], cwd=recipe, capture_output=True, text=True, timeout=600,
                            env={**run_env, "MIGRATOR_DEVICE_MEMORY_BYTES": "", "RES_PATH": str(tmp_path / "single")})
    assert single.returncode == 0, single.stderr[-3000:]
    proc = subprocess.run(["bash", "-c", command], cwd=recipe, capture_output=True, text=True, timeout=600,
                          env={**run_env, "RES_PATH": str(tmp_path / "tp2")})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert _texts(tmp_path / "tp2" / "log_0.log") == _texts(tmp_path / "single" / "log_0.log")
    for rank in (0, 1):
        log = (tmp_path / "tp2" / f"log_{rank}.log").read_text()
        held_mb = float(re.search(rf"loaded \w+ \(([\d.]+) MB, float32, tensor parallel rank {rank} of 2\)", log).group(1))
        assert held_mb * 1e6 < min(card, 0.51 * memory["weights_bytes"])
