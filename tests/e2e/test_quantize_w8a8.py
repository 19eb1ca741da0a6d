"""W8A8 int8 end to end (issue 43, items 4, 6 and 7's measure).

* Upstream's own W8A8 path (cann-recipes-infer models/qwen, qwen3_8b_w8a8_1tp.yaml: compressed-tensors from
  the checkpoint's config.json -> CompressedTensorsW8A8Int8LinearMethod, `_forward_w8a8int8`, ge_graph) runs
  under the npu stand-in on a tiny Qwen3 written W8A8 — by compressed-tensors' own library and by
  `--quantize w8a8`'s writer — and is held per step to transformers loading the same checkpoint; its record
  shows the quantized kernels. Slow (a run through upstream's launcher and a capture); the default cases
  that cover its parts: tests/unit/npu_standin/kernels/test_quant.py (the kernels and upstream's chains of
  them) and tests/unit/agent/migrate/test_quantize.py (the writer against both readers).
* `migrator run CKPT --quantize w8a8 --output-dir CHECKOUT/models` under the stand-in: the checkpoint written
  beside the recipe's state, migrated, the cost of quantizing in the report and README. Slow (a migration
  and its trial run); default cover: tests/unit/agent/measure/test_quant_cost.py and the input checks here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from agent.measure.reference import tiny_checkpoint, tiny_yaml
from migrator_cli import run_cli
from upstream_checkout import FAST, SNAPSHOT, copy_checkout


def _compressed_tensors_w8a8(source: Path, dest: Path) -> Path:
    """The tiny checkpoint quantized by compressed-tensors' own library (its W8A8 preset, the weights'
    per-channel scales, its ModelCompressor), config.json the source's with the library's quantization_config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import INT8_W8A8
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **INT8_W8A8)}, ignore=["lm_head"]))
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            w = module.weight.data
            scale, _ = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True),
                                         module.quantization_scheme.weights)
            module.weight_scale.data.copy_(scale)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    model.save_pretrained(dest)
    compressor.update_config(str(dest))
    AutoTokenizer.from_pretrained(source).save_pretrained(dest)
    written = json.loads((dest / "config.json").read_text())
    config = {**json.loads((source / "config.json").read_text()), "dtype": "bfloat16",
              "quantization_config": written["quantization_config"]}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("generation_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            (dest / name).write_bytes((source / name).read_bytes())
    return dest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("w8a8")
    return root, tiny_checkpoint("qwen3", root / "qwen3-bf16")


# ---- input checks (default) ---------------------------------------------------------------------
def test_quantize_takes_a_float_checkpoint_and_refuses_the_rest_in_one_line(tiny, tmp_path):
    root, source = tiny
    quantized = _compressed_tensors_w8a8(source, root / "already")
    proc = run_cli("run", str(quantized), "--quantize", "w8a8", "--output-dir", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"migrator: error: --quantize w8a8: {quantized} is already quantized (compressed-tensors); give it the "
        "float (bf16/fp16/fp32) checkpoint")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    if SNAPSHOT.is_dir():       # bad input before the host check (its NPU kernels would be exit 4)
        proc = run_cli("run", str(SNAPSHOT / "models" / "qwen"), "--quantize", "w8a8")
        assert proc.returncode == 2 and "is a recipe, which runs the weights its YAML names" in proc.stderr
    proc = run_cli("run", str(source), "--quantize", "int4")
    assert proc.returncode == 2 and "invalid choice: 'int4'" in proc.stderr


# ---- upstream's W8A8 path under the stand-in (slow) --------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("writer", ["compressed-tensors", "migrator"])
def test_upstream_qwen_w8a8_runs_quantized_under_the_standin_and_holds_to_transformers(tiny, tmp_path, writer):
    """compressed-tensors: its library's checkpoint, the YAML pointed at it; migrator: the one command,
    `migrator run CHECKOUT/models/qwen --standin --tiny --quantize w8a8 --yaml qwen3_8b_w8a8_1tp.yaml`."""
    root, source = tiny
    checkout = copy_checkout(tmp_path)
    recipe = checkout / "models" / "qwen"
    if writer == "compressed-tensors":
        checkpoint = _compressed_tensors_w8a8(source, tmp_path / "ct")
        tiny_yaml(recipe / "config" / "qwen3_8b_w8a8_1tp.yaml", recipe / "config" / "tiny_w8a8.yaml", checkpoint)
        assert "ge_graph" in (recipe / "config" / "tiny_w8a8.yaml").read_text()
        args = ("--yaml", "tiny_w8a8.yaml")
    else:
        args = ("--tiny", "--quantize", "w8a8", "--yaml", "qwen3_8b_w8a8_1tp.yaml")
    proc = run_cli("run", str(recipe), "--standin", *args, "--max-rounds", "0", "--json", env=FAST, timeout=1800)
    summary = json.loads(proc.stdout)
    assert proc.returncode == 0 and summary["status"] == "ok", proc.stderr[-3000:]
    precision = summary["precision"]
    assert precision["ok"] and precision["decode_steps_checked"] >= 15 and precision["reference"].startswith("transformers")
    report = json.loads((recipe / "res" / ".migrator" / "migration_report.json").read_text())
    kernels = report["standin"]["reference_kernels"]
    # upstream's W8A8 linear (dynamic quant -> quant matmul) and its fused MLP (dequant-swiglu-quant), per layer
    assert kernels["npu_quant_matmul"] > 0 and kernels["npu_dynamic_quant"] > 0 and kernels["npu_dequant_swiglu_quant"] > 0
    # per layer and step: merged_qkv, o_proj, gate_up (int32) quantize their input; down_proj takes the fused
    # op's int8 and scale: 4 quant matmuls, 3 dynamic quants, 1 dequant-swiglu-quant
    fused = kernels["npu_dequant_swiglu_quant"]
    assert kernels["npu_quant_matmul"] == 4 * fused and kernels["npu_dynamic_quant"] == 3 * fused
    assert "npu_swiglu" not in kernels                       # the float MLP never ran
    assert report["standin"]["unsupported"] == []
    assert report["standin"]["compiles"], "ge_graph's decode step was captured"
    if writer == "migrator":
        assert any("written W8A8 (--quantize)" in note for note in report["upstream_standin"]["notes"])


def test_a_quantized_yaml_on_a_float_tiny_checkpoint_says_so_and_quantize_needs_tiny(tmp_path):
    """The plan (agent.run.plan): --tiny on qwen3_8b_w8a8_1tp.yaml without --quantize runs the float path and
    its notes say so; --quantize on a recipe without --standin --tiny is bad input."""
    from agent.errors import InputError
    from agent.recipe.recipe import Recipe
    from agent.run.plan import plan_run
    from upstream_checkout import copy_snapshot

    recipe = Recipe.at(copy_snapshot(tmp_path / "ck") / "models" / "qwen")
    plan = plan_run(recipe, 1, yaml_name="qwen3_8b_w8a8_1tp.yaml", standin="cpu", tiny=True)
    assert any("names a quantized checkpoint and the tiny one is float" in n for n in plan.notes)
    plain = plan_run(recipe, 1, yaml_name="qwen3_8b_1tp.yaml", standin="cpu", tiny=True)
    assert not any("names a quantized checkpoint" in n for n in plain.notes), plain.notes
    with pytest.raises(InputError, match="pass --standin --tiny"):
        plan_run(recipe, 1, yaml_name="qwen3_8b_w8a8_1tp.yaml", standin="cpu", quantize="w8a8")
    quantized = plan_run(recipe, 1, yaml_name="qwen3_8b_w8a8_1tp.yaml", standin="cpu", tiny=True, quantize="w8a8")
    config = json.loads((Path(quantized.checkpoint) / "config.json").read_text())
    assert config["quantization_config"]["format"] == "int-quantized" and quantized.tiny


# ---- --quantize into a checkout (slow) -------------------------------------------------------------
@pytest.mark.slow
def test_run_quantize_w8a8_writes_beside_the_state_migrates_it_and_reports_the_cost(tiny, tmp_path):
    """The written checkpoint migrated natively (the file's linears take its quant_config: int8 weights,
    npu_quant_matmul), held per step to transformers loading that compressed-tensors checkpoint: ok; the cost of
    quantizing against the bf16 original beside it, in the report and the README."""
    from transformers_5_0 import tf50_site

    root, source = tiny
    python, site = tf50_site()
    checkout = copy_checkout(tmp_path)
    before = sorted(p.name for p in source.iterdir())
    proc = run_cli("standin", "--", "migrator", "run", str(source), "--quantize", "w8a8", "--output-dir",
                   str(checkout / "models"), "--name", "tiny_q", "--max-rounds", "0", "--json",
                   "--transformers-source", str(site), "--reference-python", str(python), env=FAST, timeout=2400)
    summary = json.loads(proc.stdout)
    recipe = checkout / "models" / "tiny_q"
    written = recipe / "res" / ".migrator" / "checkpoints" / f"{source.name}-w8a8"
    assert sorted(p.name for p in source.iterdir()) == before            # nothing written into the source
    config = json.loads((written / "config.json").read_text())
    assert config["quantization_config"]["format"] == "int-quantized"
    report = json.loads((recipe / "res" / ".migrator" / "migration_report.json").read_text())
    quant = report["quantization"]
    assert report["model_dir"] == str(written) and quant["checkpoint"] == str(written)
    assert quant["source"] == str(source) and quant["kept_float"] == ["lm_head"] and quant["quantized_layers"] == 14
    assert quant["command"].endswith(f"-m agent.migrate.quantize {source} {written}")
    cost = quant["cost"]
    assert cost["steps"] == 16 and 0.5 <= cost["top1_agreement"] <= 1.0 and abs(cost["nll"]["delta"]) < 0.5
    readme = (recipe / "README.md").read_text()
    section = readme[readme.index("\n## 量化\n"):readme.index("\n## 性能基线\n")]
    assert str(written) in section and "top-1 agreement" in section and quant["command"] in section
    assert "| W8A8 |" in readme[readme.index("\n## 性能基线\n"):]
    assert summary["status"] == "ok" and summary["precision"]["ok"] and summary["precision"]["checked"], summary
    assert "does not thread quant_config" not in proc.stderr
    kernels = report["standin"]["reference_kernels"]
    assert kernels["npu_quant_matmul"] > 0 and kernels["npu_dynamic_quant"] > 0, kernels
    assert os.path.isdir(written)
