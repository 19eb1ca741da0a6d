"""Two ranks on CPU through torchrun (gloo): both log, the baseline covers every rank."""

from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import repair_run


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
