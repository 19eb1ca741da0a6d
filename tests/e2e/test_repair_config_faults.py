"""Fault injection into a recipe's YAML (agent/repair/rules/config.py): a working recipe's YAML broken as people
break it, `migrator run RECIPE` repairs it in a round (or says why not). The rules' matchers and fixes
in-process: tests/unit/agent/repair/rules/test_config.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from migrator_cli import assert_repaired, repair_run


@pytest.mark.slow  # end-to-end round; the in-process matcher and fix tests of this rule stay in the default suite
def test_dtype_the_device_cannot_run_is_set_to_float32(working_recipe, monkeypatch):
    # In practice: a recipe written for NPU (float16) run on a CPU that lacks a half kernel.
    # The tiny model runs float16 on CPU, so the fault is the kernel error an older torch raises.
    yaml_file = next((working_recipe / "config").glob("*.yaml"))
    yaml_file.write_text(yaml_file.read_text().replace("dtype: float32", "dtype: float16"))
    runner = working_recipe / "runner_fi.py"
    source = runner.read_text().replace("from engine.model_runner import ModelRunner\n",
                                        "from engine.model_runner import ModelRunner, torch\n")
    runner.write_text(source + (
        "\n    def model_input_prepare(self, batch):\n"
        "        if self.dtype == torch.float16 and self.device.type == 'cpu':\n"
        "            raise RuntimeError('\"addmm_impl_cpu_\" not implemented for \\'Half\\'')\n"
        "        return super().model_input_prepare(batch)\n"))
    injected = {str(yaml_file.relative_to(working_recipe)): yaml_file.read_bytes()}
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "dtype_unsupported_on_device", injected)
    assert "dtype: float32" in yaml_file.read_text()


# ---- fault injection (a real `migrator run` on a broken recipe) ---------------------------
def _yaml(recipe: Path) -> Path:
    return next((recipe / "config").glob("*.yaml"))


def _inject(recipe: Path, old: str, new: str) -> tuple[Path, bytes, dict]:
    """Replace one line of the YAML; returns (file, original bytes, injected map)."""
    path = _yaml(recipe)
    original = path.read_bytes()
    text = original.decode()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))
    return path, original, {str(path.relative_to(recipe)): path.read_bytes()}


@pytest.mark.slow  # end-to-end round; the in-process matcher and fix tests of this rule stay in the default suite
def test_missing_max_new_tokens_is_added_back(working_recipe):
    # In practice: a YAML trimmed by hand, or copied from an older recipe version.
    path, original, injected = _inject(working_recipe, "  max_new_tokens: 8\n", "")
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "yaml_missing_key", injected)
    # default 32 capped so that input_max_len (504) + max_new_tokens fits the 512 positions,
    # added where the template has it: the file is as it was.
    assert path.read_bytes() == original
    assert len(report["rounds"]) == 1


@pytest.mark.slow  # end-to-end round; the in-process matcher and fix tests of this rule stay in the default suite
def test_quoted_batch_size_is_read_as_int(working_recipe):
    path, original, injected = _inject(working_recipe, "  batch_size: 1\n", '  batch_size: "1"\n')
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "yaml_wrong_type", injected)
    assert path.read_bytes() == original


@pytest.mark.slow  # end-to-end round; this rule's matcher and fix are tested in-process in this file
def test_dtype_alias_bf16_is_mapped_to_bfloat16(working_recipe):
    path, original, injected = _inject(working_recipe, "  dtype: float32\n", "  dtype: bf16\n")
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "yaml_wrong_type", injected)
    assert path.read_text() == original.decode().replace("dtype: float32", "dtype: bfloat16")


def test_model_path_that_does_not_exist_uses_the_report_s_model_dir(working_recipe, tmp_path):
    # In practice: the checkpoint moved, or the YAML came from another machine.
    old_line = next(ln for ln in _yaml(working_recipe).read_text().splitlines(True) if ln.startswith("model_path:"))
    gone = tmp_path / "moved_away" / "ckpt"
    path, original, injected = _inject(working_recipe, old_line, f'model_path: "{gone}"\n')
    model_dir = json.loads((working_recipe / "migration_report.json").read_text())["model_dir"]
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "model_path_missing", injected)
    assert yaml.safe_load(path.read_text())["model_path"] == str(Path(model_dir).resolve())
    assert report["rounds"][0]["diff"].count("\n-model_path") == 1 and report["rounds"][0]["diff"].count("\n+") == 2


def test_model_path_missing_never_points_at_a_neighbouring_checkpoint(working_recipe, tmp_path):
    """No report model_dir to go back to (the report was removed), and another user's checkpoint sits
    where the old path was: the YAML is left alone, the run says which folders it saw (exit 1)."""
    import shutil

    model_dir = Path(json.loads((working_recipe / "migration_report.json").read_text())["model_dir"])
    (working_recipe / "migration_report.json").unlink()
    gone = tmp_path / "shared" / "ckpt"
    neighbour = tmp_path / "shared" / "someone_elses_ckpt"
    shutil.copytree(model_dir, neighbour)
    old_line = next(ln for ln in _yaml(working_recipe).read_text().splitlines(True) if ln.startswith("model_path:"))
    path, original, injected = _inject(working_recipe, old_line, f'model_path: "{gone}"\n')
    proc, summary, report = repair_run(working_recipe)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert path.read_bytes() == injected[path.relative_to(working_recipe).as_posix()]
    assert report["rounds"][0]["diagnosis"]["rule"] == "model_path_missing" and not report["rounds"][0]["applied"]
    assert str(neighbour) in summary["message"] and "not chosen for you" in summary["message"], summary


@pytest.mark.slow  # end-to-end round; the in-process matcher and fix tests of this rule stay in the default suite
def test_input_max_len_beyond_the_positions_is_lowered(working_recipe):
    path, original, injected = _inject(working_recipe, "  input_max_len: 504\n", "  input_max_len: 100000\n")
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "lengths_exceed_positions", injected)
    assert path.read_bytes() == original                    # 512 positions - 8 new tokens


@pytest.mark.slow  # end-to-end round; the in-process matcher and fix tests of this rule stay in the default suite
def test_device_this_machine_lacks_is_set_to_auto(working_recipe):
    # In practice: a recipe written on a GPU/NPU machine run on another one.
    import torch

    missing = "cuda" if not torch.cuda.is_available() else ("npu" if not hasattr(torch, "npu") else None)
    if missing is None:
        pytest.skip("this machine has both cuda and npu")
    path, original, injected = _inject(working_recipe, "device: cpu\n", f"device: {missing}\n")
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "device_unavailable", injected)
    assert path.read_text() == original.decode().replace("device: cpu", "device: auto")
    # the run records the device it really used
    assert report["runs"][-1]["ok"] and "DeviceUnavailableError" in report["rounds"][0]["diagnosis"]["error"]


@pytest.mark.slow  # end-to-end round; this rule's matcher and fix are tested in-process in this file
def test_deleted_yaml_is_re_rendered(working_recipe):
    path = _yaml(working_recipe)
    before = yaml.safe_load(path.read_text())
    path.unlink()
    injected = {str(path.relative_to(working_recipe)): None}
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "yaml_file_missing", injected)
    after = yaml.safe_load(path.read_text())
    assert after["model_path"] == before["model_path"] and after["model_name"] == "fi"
    assert after["device"] == "auto" and after["model_config"]["dtype"] == "float32"
    assert after["data_config"]["input_max_len"] + after["data_config"]["max_new_tokens"] <= 512


@pytest.mark.slow  # end-to-end round; the in-process matcher and fix tests of this rule stay in the default suite
def test_hanging_run_is_reported_with_where_it_stopped(working_recipe):
    # In practice: a rank waiting forever (here: infer.py blocks right after loading the model).
    infer = working_recipe / "infer.py"
    infer.write_text(infer.read_text().replace("    runner.init_model()\n",
                                               "    runner.init_model()\n    print('loaded', flush=True)\n"
                                               "    import time; time.sleep(3600)\n"))
    def sources():
        return {p: p.read_bytes() for p in working_recipe.rglob("*.py") if ".migrator" not in p.parts}

    before = sources()
    proc, summary, report = repair_run(working_recipe, "--timeout", "25")
    assert proc.returncode == 1 and summary["status"] == "failed"
    first = report["rounds"][0]
    assert first["diagnosis"]["rule"] == "run_timed_out" and not first["applied"]
    assert "--timeout 25s" in summary["message"] and "loaded" in summary["message"]
    assert sources() == before     # report only
    assert len(report["runs"]) == 1    # classify's run only: a report-only rule ends the loop
