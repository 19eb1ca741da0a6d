"""Published quantized checkpoints through `migrator run`, as a user runs it: converted at migration (the
report and the recipe README say what, where, and the command that redoes it), the recipe run on the converted
checkpoint and held to transformers on it.

All `slow` (about 3 minutes each on 2 cores; the default suite runs the conversion's path through acquire,
vendor and render in-process: tests/unit/agent/workflow/test_nodes.py::
test_acquire_converts_a_checkpoint_the_npu_cannot_compute_and_render_documents_it, and the conversion itself in
tests/unit/agent/migrate/test_convert.py): a standalone migration of the Qwen3-8B-FP8 form (the trial run and the
precision check on the converted weights), the DeepSeek-V3 form (block-FP8, MLA + MoE, auto_map) into a copy of the upstream
checkout under the stand-in, without its MTP layer and with it (the native model skips the MTP layer's tensors
by name), each verdict ok; the compressed-tensors W8A8 dense form run int8 natively (npu_quant_matmul)."""

from __future__ import annotations

import json
import sys

import pytest

import quantized_checkpoints as forms
from locations import REPO_ROOT
from migrator_cli import run_cli
from upstream_checkout import copy_checkout

pytestmark = pytest.mark.e2e


def _summary(proc) -> dict:
    return json.loads(proc.stdout[proc.stdout.index("{"):proc.stdout.rindex("}") + 1])


@pytest.mark.slow
def test_an_fp8_checkpoint_migrates_converted_and_the_report_says_how(tmp_path):
    src, _ = forms.qwen3_fp8(tmp_path / "Qwen3-8B-FP8")
    proc = run_cli("run", str(src), "--output-dir", str(tmp_path / "models"), "--device", "cpu",
                   "--max-new-tokens", "4", "--max-rounds", "0", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(proc)
    recipe = tmp_path / "models" / "qwen3_8b_fp8"
    assert summary["status"] == "ok" and summary["precision"]["ok"], summary
    report = json.loads((recipe / "migration_report.json").read_text())
    converted = recipe / ".migrator" / "checkpoints" / "bfloat16"
    conversion = report["conversion"]
    assert conversion["path"] == str(converted) == report["model_dir"]
    assert conversion["format"] == "block-FP8 (quant_method fp8, weight_block_size 128x128)"
    assert conversion["tensors"]["quantized"] == 14 and conversion["upstream_converter"] is None   # no MTP key: none
    assert conversion["command"] == f"migrator convert {src} {converted}"
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())
    assert "quantization_config" in json.loads((src / "config.json").read_text())      # the source is untouched
    readme = (recipe / "README.md").read_text()
    assert "## 权重转换" in readme and conversion["command"] in readme
    summary_md = (recipe / "migration_summary.md").read_text()
    assert "block-FP8 (quant_method fp8, weight_block_size 128x128) converted to bfloat16" in summary_md


def _standin_run(tmp_path, checkpoint, name):
    checkout = copy_checkout(tmp_path)
    python = REPO_ROOT / ".venv-tf5.0" / "bin" / "python"
    extra = ["--reference-python", str(python)] if python.is_file() else ["--transformers-source", "installed"]
    proc = run_cli("standin", "--", sys.executable, "-m", "agent.cli", "run", str(checkpoint), "--output-dir",
                   str(checkout / "models"), "--name", name, "--max-new-tokens", "8", "--max-rounds", "0", "--json",
                   *extra, cwd=tmp_path, timeout=1800)
    return checkout, proc


@pytest.mark.slow
def test_deepseek_v3_form_without_mtp_migrates_natively_under_the_standin(tmp_path):
    """The DeepSeek-V3 form (block-FP8 with partial blocks, MLA + MoE, auto_map) with one command: converted, served
    by transformers' DeepseekV3ForCausalLM (not the repo's code), written as the native MLA + MoE framework model,
    run by upstream's launcher under the stand-in, per step against transformers: ok."""
    src, _ = forms.deepseek_v3_fp8(tmp_path / "DeepSeek-V3", shards=3, num_nextn_predict_layers=0)
    checkout, proc = _standin_run(tmp_path, src, "deepseek_v3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(proc)
    assert summary["status"] == "ok" and summary["precision"]["ok"] and summary["precision"]["checked"], summary
    report = json.loads((checkout / "models/deepseek_v3/res/.migrator/migration_report.json").read_text())
    assert report["native_model"]["native"] and report["conversion"]["tensors"]["quantized"] == 28
    assert report["vendored"]["modeling_module"] == "transformers.models.deepseek_v3.modeling_deepseek_v3"
    assert "served by transformers' own class" in report["vendored"]["auto_map_note"]
    assert not (src / forms.REMOTE_CODE_MARKER).exists()


@pytest.mark.slow
def test_deepseek_v3_form_with_its_mtp_layer_migrates_under_the_standin(tmp_path):
    """As published, with its MTP layer (model.layers.{num_hidden_layers}.*): the native model does not build it,
    its tensors are skipped by name with one log line, the run's verdict is ok."""
    src, _ = forms.deepseek_v3_fp8(tmp_path / "DeepSeek-V3", shards=3)
    checkout, proc = _standin_run(tmp_path, src, "deepseek_v3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(proc)
    assert summary["status"] == "ok" and summary["precision"]["ok"] and summary["precision"]["checked"], summary
    report = json.loads((checkout / "models/deepseek_v3/res/.migrator/migration_report.json").read_text())
    assert report["native_model"]["native"]


@pytest.mark.slow
def test_a_compressed_tensors_w8a8_checkpoint_runs_int8_natively_under_the_standin(tmp_path):
    """The compressed-tensors int8 W8A8 dense form (RedHatAI's / AMCT's Qwen3 W8A8), one command: not converted,
    the native file's linears built by upstream's module.quantization from the checkpoint's quantization_config
    (int8 weights, npu_dynamic_quant + npu_quant_matmul, the fused npu_dequant_swiglu_quant MLP), held per step
    to transformers loading the same checkpoint (its compressed-tensors quantizer): ok. Default-suite cover of its
    parts: tests/unit/agent/recipe/native/test_native_quantized.py."""
    src, _ = forms.qwen3_w8a8(tmp_path / "Qwen3-8B-W8A8")
    checkout, proc = _standin_run(tmp_path, src, "qwen3_w8a8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(proc)
    assert summary["status"] == "ok" and summary["precision"]["ok"] and summary["precision"]["checked"], summary
    assert "does not thread quant_config" not in proc.stderr
    report = json.loads((checkout / "models/qwen3_w8a8/res/.migrator/migration_report.json").read_text())
    assert report["native_model"]["native"] and report["native_model"]["quant_config"]
    assert report["model_dir"] == str(src) and not report.get("conversion")           # run as published
    kernels = report["standin"]["reference_kernels"]
    assert kernels["npu_quant_matmul"] > 0 and kernels["npu_dynamic_quant"] > 0, kernels
    # per layer and step: qkv, o_proj, gate_up (int32 out) and down_proj; down_proj takes the fused op's int8
    assert kernels["npu_quant_matmul"] == 4 * kernels["npu_dequant_swiglu_quant"], kernels
    assert "npu_swiglu" not in kernels                       # the float MLP never ran
