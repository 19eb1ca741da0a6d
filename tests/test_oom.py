"""OOM path: a real out-of-memory under a memory cap ends in an estimate and exit code 6."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

from conftest import REPO_ROOT, run_cli


def test_memory_capped_run_ends_in_the_oom_report(tiny_checkpoints, tmp_path):
    # ~400 MB of fp32 weights and a batch whose KV cache and activations do not fit the cap.
    ckpt = tiny_checkpoints("llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=6,
                            num_attention_heads=8, num_key_value_heads=8, head_dim=128)
    proc = run_cli("run", str(ckpt), "--name", "big", "--output-dir", str(tmp_path), "--device", "cpu",
                   "--max-new-tokens", "8")
    assert proc.returncode == 0, proc.stderr[-2000:]
    recipe = tmp_path / "big"
    yaml_file = next((recipe / "config").glob("*.yaml"))
    yaml_file.write_text(yaml_file.read_text().replace("batch_size: 1", "batch_size: 512"))
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
    assert f"world_size: {memory['suggested_world_size']}" in summary["message"]
    # The single-card recipe is kept as the basis for parallelisation.
    assert (recipe / "infer.sh").is_file() and "world_size: 1" in next((recipe / "config").glob("*.yaml")).read_text()
    assert memory["batch_size"] == 512 and memory["kv_cache_bytes"] > 0
