"""Two ranks on CPU through torchrun (gloo): both log, the baseline covers every rank."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from migrator_cli import repair_run
from locations import REPO_ROOT


@pytest.mark.slow  # test_run_world_size_2_… covers two ranks by default
def test_two_rank_cpu_run_logs_both_ranks_and_a_green_baseline(working_recipe):
    yaml_file = next((working_recipe / "config").glob("*.yaml"))
    text = yaml_file.read_text().replace("world_size: 1", "world_size: 2").replace("batch_size: 1", "batch_size: 2")
    yaml_file.write_text(text)
    proc, summary, report = repair_run(working_recipe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary["scenario"] == "C" and summary["status"] == "ok"
    run_dir = Path(report["runs"][-1]["res_path"])
    logs = sorted(p.name for p in run_dir.glob("log_*.log"))
    assert logs == ["log_0.log", "log_1.log"]
    for log in logs:
        text = (run_dir / log).read_text()
        env = json.loads(re.search(r"environment: (\{.*\})", text).group(1))
        assert env["world_size"] == 2
        assert text.count("inference time cost of prefill") == 2 and "Request 0: outputs:" in text
    baseline = json.loads((working_recipe / "baseline" / "baseline_metadata.json").read_text())
    assert baseline["verification"]["all_ranks_success"] is True
    assert baseline["environment"]["device"] == "cpu" and baseline["environment"]["num_cards"] == 0
    assert baseline["performance"]["prefill_ms"] > 0


def _texts(log: Path) -> list[str]:
    return re.findall(r"Request 0: outputs: (.*)", log.read_text())


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow  # test_run_world_size_2_… covers two ranks by default
def test_two_nodes_on_localhost_run_tensor_parallel_with_the_single_card_text(working_recipe, working_recipe_source,
                                                                              tmp_path):
    """Two torchrun processes (--nnodes 2, static rendezvous on localhost), one rank each, as two
    machines would run them: infer.sh passes NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT through."""
    from agent.recipe.recipe import Recipe

    single = _texts(next((working_recipe_source / ".migrator" / "runs").glob("run_*/log_0.log")))
    yaml_file = Recipe.at(working_recipe).write_yaml_for(2)
    port = _free_port()
    nodes = []
    for node_rank in (0, 1):
        env = {**os.environ, "NNODES": "2", "NODE_RANK": str(node_rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "YAML_FILE": f"config/{yaml_file.name}", "PYTHON": sys.executable,
               "RES_PATH": str(tmp_path / f"node{node_rank}"), "OMP_NUM_THREADS": "1"}
        nodes.append(subprocess.Popen(["bash", "infer.sh"], cwd=working_recipe, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    # Each machine writes the logs of its own ranks.
    assert sorted(p.name for p in (tmp_path / "node0").glob("log_*.log")) == ["log_0.log"]
    assert sorted(p.name for p in (tmp_path / "node1").glob("log_*.log")) == ["log_1.log"]
    for node_rank in (0, 1):
        log = tmp_path / f"node{node_rank}" / f"log_{node_rank}.log"
        assert re.search(rf"loaded \w+ \([\d.]+ MB, float32, tensor parallel rank {node_rank} of 2\)", log.read_text())
        assert _texts(log) == single


@pytest.mark.slow  # tests/e2e/test_oom.py's simulated card runs the 2-card tensor-parallel YAML by default
def test_run_world_size_2_renders_the_2card_yaml_and_runs_the_demo_model_tensor_parallel(tmp_path):
    """`migrator run SOURCE --world-size 2` on the shipped demo model (tied embeddings: lm_head shares
    the sharded embedding) with the vendored classes: rank 0's text is the single card's."""
    from migrator_cli import run_cli

    demo = REPO_ROOT / "demo" / "tiny-attention-llama"
    proc = run_cli("run", str(demo), "--name", "dl", "--output-dir", str(tmp_path), "--device", "cpu",
                   "--max-new-tokens", "8", "--world-size", "2", "--json", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["scenario"] == "A" and summary["status"] == "ok"
    recipe = tmp_path / "dl"
    assert sorted(p.name for p in (recipe / "config").glob("*.yaml")) == ["dl_2card_eager.yaml"]
    text = (recipe / "config" / "dl_2card_eager.yaml").read_text()
    assert "world_size: 2" in text and "attn_tp_size: 2" in text and "lmhead_tp_size: 2" in text
    report = json.loads((recipe / "migration_report.json").read_text())
    run_dir = Path(report["runs"][-1]["res_path"])
    held = []
    for rank in (0, 1):
        log = (run_dir / f"log_{rank}.log").read_text()
        held.append(float(re.search(rf"loaded \w+ \(([\d.]+) MB, float32, tensor parallel rank {rank} of 2\)", log).group(1)))
    assert held[0] == held[1]
    baseline = json.loads((recipe / "baseline" / "baseline_metadata.json").read_text())
    assert baseline["verification"]["all_ranks_success"] is True
    # The single card's text: the same recipe on one card (the parity check ran it one process too).
    assert baseline["verification"]["parity"]["ok"] is True
    import yaml

    settings = yaml.safe_load(text)
    settings.update(world_size=1, parallel_config={"attn_tp_size": 1, "moe_tp_size": 1, "lmhead_tp_size": 1})
    (recipe / "config" / "one.yaml").write_text(yaml.safe_dump(settings))
    single = subprocess.run(["bash", "infer.sh"], cwd=recipe, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHON": sys.executable, "RES_PATH": str(tmp_path / "single"),
                                 "YAML_FILE": "config/one.yaml", "PYTHONPATH": str(demo.parent.parent)})
    assert single.returncode == 0, single.stderr[-3000:]
    assert _texts(run_dir / "log_0.log") == _texts(tmp_path / "single" / "log_0.log")


@pytest.mark.slow
def test_existing_single_card_recipe_runs_and_baselines_on_2_cards_with_world_size(working_recipe):
    """`migrator run RECIPE --world-size 2`: the 2-card YAML is written next to the 1-card one, run
    tensor parallel and baselined in the same invocation."""
    proc, summary, report = repair_run(working_recipe, "--world-size", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary["scenario"] == "C" and summary["status"] == "ok"
    assert sorted(p.name for p in (working_recipe / "config").glob("*.yaml")) == ["fi_1card_eager.yaml",
                                                                                  "fi_2card_eager.yaml"]
    run_dir = Path(report["runs"][-1]["res_path"])
    for rank in (0, 1):
        assert f"tensor parallel rank {rank} of 2" in (run_dir / f"log_{rank}.log").read_text()
    baseline = json.loads((working_recipe / "baseline" / "baseline_metadata.json").read_text())
    assert baseline["yaml_path"] == "config/fi_2card_eager.yaml"
    assert baseline["verification"]["all_ranks_success"] is True
