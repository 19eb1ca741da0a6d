"""The cost of quantizing (agent.measure.quant_cost): a faithful W8A8 conversion of a trained model agrees
with it step for step at the same NLL; one whose scales are off (by a factor, in every layer or in one)
does not, and the measure says so. The model is the repository's trained demo llama (demo/), whose
predictions on the default prompt are confident, so agreement means something."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agent.measure import quant_cost
from agent.migrate import quantize
from locations import REPO_ROOT

DEMO = REPO_ROOT / "demo" / "tiny-attention-llama"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("cost")
    return Path(quantize.quantize_w8a8(DEMO, root / "w8a8").checkpoint)


@pytest.fixture(scope="module")
def faithful(converted):
    return quant_cost.quantization_cost(DEMO, converted)


def _scaled(checkpoint: Path, dest: Path, factor: float, only: str | None = None) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, dest)
    tensors = load_file(dest / "model.safetensors")
    for name in tensors:
        if name.endswith("weight_scale") and (only is None or only in name):
            tensors[name] = tensors[name] * factor
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_a_faithful_w8a8_conversion_agrees_at_every_step_at_the_same_nll(faithful):
    cost = faithful
    assert cost["steps"] == quant_cost.STEPS and cost["prompt_tokens"] > 10
    assert cost["top1_agreement"] == 1.0 and cost["first_disagreement"] is None
    assert abs(cost["nll"]["delta"]) < 0.05 and cost["nll"]["original"] < 1.0      # a trained model: it predicts
    assert cost["mean_kl"] < 0.01
    assert len(cost["per_step_nll"]) == cost["steps"]
    assert "agreement 16/16 steps (every step)" in quant_cost.line(cost)


@pytest.mark.parametrize("factor, only", [(4.0, None), (8.0, "layers.0.self_attn.o_proj")])
def test_scales_off_by_a_factor_show_as_low_agreement_and_high_nll(converted, tmp_path, factor, only):
    broken = _scaled(converted, tmp_path / "broken", factor, only)
    cost = quant_cost.quantization_cost(DEMO, broken)
    assert cost["top1_agreement"] <= 0.5, cost["agree"]
    assert cost["nll"]["delta"] > 1.0 and cost["first_disagreement"] is not None
    assert cost["mean_kl"] > 0.5


def test_a_milder_fault_keeps_the_top_token_but_not_the_nll(converted, faithful, tmp_path):
    """One layer's scale off where the model's margin absorbs it: top-1 holds, the NLL and KL show it,
    against the faithful conversion's ~0 (the figures are reported side by side for this reason)."""
    broken = quant_cost.quantization_cost(DEMO, _scaled(converted, tmp_path / "mild", 8.0, "layers.1.mlp.down_proj"))
    assert broken["nll"]["delta"] > 0.05 > abs(faithful["nll"]["delta"]) * 10
    assert broken["mean_kl"] > 10 * max(faithful["mean_kl"], 1e-4)


def test_the_one_line_says_what_was_not_measured():
    assert quant_cost.line({"error": "timed out after 9 s"}) == "not measured (timed out after 9 s)"
    assert quant_cost.line({"nll": "x", "agree": [True]}) == "not measured"       # a report read back, malformed
    line = quant_cost.line({"agree": [True, False, True], "first_disagreement": 1,
                            "nll": {"original": 1.0, "quantized": 1.5, "delta": 0.5}})
    assert line.startswith("top-1 agreement 2/3 steps (first differs at step 1)") and "+0.5000" in line


def test_measure_runs_it_in_a_subprocess_and_reports_a_failure_in_one_line(converted, tmp_path):
    got = quant_cost.measure(DEMO, converted, timeout=600)
    assert got["top1_agreement"] == 1.0
    script = tmp_path / "fails.sh"          # an interpreter that fails: its error line is the reason
    script.write_text("#!/bin/sh\necho 'first line' >&2\necho 'OSError: no such checkpoint' >&2\nexit 3\n")
    script.chmod(0o755)
    failed = quant_cost.measure(DEMO, tmp_path / "nowhere", python=str(script))
    assert failed == {"error": "OSError: no such checkpoint"}     # its error line (agent.child_failure)
