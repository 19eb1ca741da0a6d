"""`migrator demo` (the README's first command): shipped trained model -> readable, checked text."""

from __future__ import annotations

import json

from migrator_cli import run_cli


def test_demo_migrates_the_shipped_model_with_readable_checked_output(tmp_path):
    proc = run_cli("demo", "--output-dir", str(tmp_path), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    baseline = json.loads((tmp_path / "demo_tiny_attention_llama" / "baseline" / "baseline_metadata.json").read_text())
    verification = baseline["verification"]
    assert verification["output_check"]["ok"] is True          # judged as text: trained weights
    assert verification["parity"]["untrained_weights"] is False and verification["parity"]["ok"]
    assert baseline["performance"]["output_text"].startswith(" computed as a weighted sum of the values")
    assert summary["status"] == "ok"
