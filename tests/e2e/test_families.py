"""Architecture coverage: every family routes, migrates, runs and matches transformers.

Each case is a real `migrator run` on a tiny checkpoint: vendoring, rendering, `bash infer.sh`,
baseline collection and the parity check against AutoModelForCausalLM (fp32 logits <= 1e-4,
identical greedy tokens) that the workflow records in the baseline.
"""

from __future__ import annotations

import json
import re

import pytest

from migrator_cli import run_cli

# model_type -> family the routing table must pick (from config features, not names)
FAMILY_CASES = {
    "gemma": "standard",
    "gemma2": "sliding_window",
    "gemma3_text": "sliding_window",
    "phi3": "standard",
    "gpt_neox": "standard",
    "olmo2": "standard",
    "qwen2_moe": "moe",
    "qwen3_moe": "moe",
    "mixtral": "moe",
    "deepseek_v3": "mla",
    "gpt_oss": "moe",
    "qwen3_next": "hybrid_recurrent",   # linear attention + MoE; needs its own cache class
}
# Tiny-config adjustments a family needs to be itself (not a model-name special case in the tool).
OVERRIDES = {"qwen3_next": {"num_hidden_layers": 4}}   # 4 layers: 3 linear + 1 full attention


# One case per family runs by default; the others repeat a family's path on another model type and are
# `slow` (`make test-all`).
DEFAULT_CASES = {"gemma2", "qwen3_moe", "deepseek_v3", "qwen3_next"}   # standard: llama in test_migrate_e2e.py


@pytest.mark.parametrize("model_type,family", [
    pytest.param(m, f, marks=() if m in DEFAULT_CASES else pytest.mark.slow)
    for m, f in sorted(FAMILY_CASES.items())])
def test_family_migrates_with_parity(model_type, family, tiny_checkpoints, tmp_path):
    from agent.migrate.transformers_range import needed_version

    ckpt = tiny_checkpoints(model_type, **OVERRIDES.get(model_type, {}))
    proc = run_cli("run", str(ckpt), "--name", "m", "--output-dir", str(tmp_path), "--device", "cpu", "--json")
    too_old = needed_version(model_type)
    if too_old is not None:     # the old end of the range (CI's transformers 5.0.0 run): refused, one line
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("migrator: error:")]
        assert proc.returncode == 3 and len(errors) == 1 and f"transformers >= {too_old.version}" in errors[0]
        assert not (tmp_path / "m").exists()
        return
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["status"] == "ok" and summary["family"] == family
    recipe = tmp_path / "m"
    baseline = json.loads((recipe / "baseline" / "baseline_metadata.json").read_text())
    parity = baseline["verification"]["parity"]
    assert parity["checked"] and parity["max_abs_logits_diff"] <= 1e-4, parity
    assert parity["greedy_tokens_equal"] and parity["greedy_tokens"] >= 1
    assert baseline["performance"]["prefill_ms"] > 0 and baseline["performance"]["decode_avg_ms"] > 0
    report = json.loads((recipe / "migration_report.json").read_text())
    assert report["runs"][-1]["ok"] and report["family"] == family
    modeling = (recipe / "models" / "modeling_m.py").read_text()
    assert not re.search(r"^from transformers\.models\.[\w.]*modeling_\w+ import", modeling, re.M)


@pytest.mark.parametrize("model_type,expected", [
    ("bert", "encoder-only"),
    ("t5", "encoder-decoder"),
    ("vit", "no causal-LM head"),
    ("whisper", "encoder-decoder"),
])
def test_unservable_architectures_are_refused(model_type, expected, tmp_path):
    from transformers import AutoConfig

    ckpt = tmp_path / model_type
    AutoConfig.for_model(model_type).save_pretrained(ckpt)
    proc = run_cli("run", str(ckpt), "--output-dir", str(tmp_path / "out"), "--device", "cpu")
    assert proc.returncode == 3, proc.stderr
    error = [ln for ln in proc.stderr.splitlines() if ln.startswith("migrator: error:")]
    assert len(error) == 1 and "Traceback" not in proc.stderr
    assert expected in error[0] and "supported: decoder-only" in error[0] and "moe" in error[0]
    assert not (tmp_path / "out" / model_type).exists()


def test_a_quantized_checkpoint_the_migrator_neither_serves_nor_converts_is_refused_in_one_line(tiny_checkpoints,
                                                                                                 tmp_path):
    """bitsandbytes (no route on the NPU, no dequantization here, no converter of upstream): the true line (exit 3,
    nothing written), naming the quantization; compressed-tensors W8A8 int8 is served
    (tests/e2e/test_quantize_w8a8.py), fp8 / mxfp4 / AWQ / GPTQ converted (tests/e2e/test_quantized_checkpoints.py,
    tests/unit/agent/migrate/test_convert.py); every route: tests/unit/agent/migrate/test_quantization.py."""
    import shutil

    ckpt = tmp_path / "bnb"
    shutil.copytree(tiny_checkpoints("llama"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    (ckpt / "config.json").write_text(json.dumps(config))
    proc = run_cli("run", str(ckpt), "--output-dir", str(tmp_path / "out"), "--device", "cpu")
    error = [ln for ln in proc.stderr.splitlines() if ln.startswith("migrator: error:")]
    assert proc.returncode == 3 and len(error) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "weights are quantized: bitsandbytes (4-bit nf4), which the migrator neither serves nor converts" in error[0]
    assert "no converter of cann-recipes-infer reads it" in error[0]
    assert not (tmp_path / "out" / "bnb").exists()
