"""A quantized checkpoint's verdict says what its reference ran (issue 43 item 7): transformers' own quantizer on the
same quantized weights as the recipe (agent.measure.precision.quantized_weights, read by
agent.migrate.quantization), in the report's parity and the summary's line; a float checkpoint's says nothing of it.
The verdict itself on quantized weights, with a wrong scale it must fail: tests/unit/agent/recipe/native/
test_native_quantized.py and, through upstream's launcher, tests/e2e/test_precision_faults.py (slow)."""

from __future__ import annotations

import json

import pytest

from agent.measure.precision import quantized_weights
from agent.migrate.quantize import quantization_config
from agent.workflow.report import parity_line

PARITY = {"ok": True, "checked": True, "method": "precision, per step, teacher-forced", "steps_checked": 9,
          "decode_steps_checked": 8, "requests": 1, "ranks": 1, "dtype": "bfloat16"}


def _checkpoint(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", **config}))
    return tmp_path


@pytest.mark.parametrize("quant,says", [
    (quantization_config(["lm_head"]), "compressed-tensors (int8 W8A8 dynamic per token, format int-quantized)"),
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}, "block-FP8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True}, "AWQ"),
])
def test_a_quantized_checkpoints_reference_is_named_as_its_quantized_weights(tmp_path, quant, says):
    found = quantized_weights(_checkpoint(tmp_path, quantization_config=quant))
    assert found is not None and found.startswith(says) and "transformers' own quantizer" in found, found
    line = parity_line({**PARITY, "reference_weights": found})
    assert line.startswith("ok (") and f"reference: {found}" in line


@pytest.mark.parametrize("config", [{}, {"quantization_config": None}])
def test_a_float_checkpoint_or_an_unreadable_config_says_nothing_of_it(tmp_path, config):
    assert quantized_weights(_checkpoint(tmp_path, **config)) is None
    (tmp_path / "config.json").write_text("{not json")
    assert quantized_weights(tmp_path) is None
    assert quantized_weights(tmp_path / "absent") is None
    assert "reference:" not in parity_line(PARITY)
