"""scripts/bench_recipe.py --quick: the whole benchmark on the 2-layer test model, in seconds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from locations import REPO_ROOT


@pytest.mark.slow  # a benchmark run; `python scripts/bench_recipe.py --quick` runs the same
def test_bench_quick_prints_the_ratios_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "bench_recipe.py"), "--quick", "--threads", "1",
         "--workdir", str(tmp_path / "work"), "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    for line in ("ratio eager / transformers per-token time:", "ratio transformers / graph speedup:",
                 "migrator overhead to a rendered recipe:", "recipe eager", "recipe graph",
                 "transformers generate()", "parameters"):
        assert line in text, text[-3000:]

    data = json.loads(out.read_text())
    assert set(data["per_token_ms"]) == {"recipe eager", "recipe graph", "transformers generate()"}
    assert all(ms > 0 for ms in data["per_token_ms"].values())
    # Achieved bandwidth: the weights read once per decode step.
    assert data["weight_bytes"] > 0 and "GB/s" in text
    for label, ms in data["per_token_ms"].items():
        assert abs(data["achieved_bandwidth_gbps"][label] - data["weight_bytes"] / ms / 1e6) < 1e-6
    # The limit is measured on this host; the floor is the weights read once at that rate.
    assert data["measured_read_limit_gbps"] > 0 and "measured memory-read limit" in text
    assert abs(data["floor_ms"] - data["weight_bytes"] / data["measured_read_limit_gbps"] / 1e6) < 1e-9
    for label, ms in data["per_token_ms"].items():
        assert abs(data["times_floor"][label] - ms / data["floor_ms"]) < 1e-9
    assert set(data["ratios"]) == {"eager_vs_transformers", "transformers_vs_graph"}
    assert data["migrator_overhead"]["wall_s"] > 0
    assert set(data["migrator_overhead"]["steps_s"]) == {"detect_env", "classify", "acquire", "vendor", "decide_native", "render"}
    # Same weights, greedy, same number of tokens: the three agree on the tokens.
    assert data["tokens_match"] == {"graph_equals_eager": True, "eager_equals_transformers": True}
