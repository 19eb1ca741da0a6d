"""Remote-code models (auto_map): vendored only with --trust-remote-code."""

from __future__ import annotations

import json

import pytest

from migrator_cli import run_cli
from remote_fixture import build_remote_code_checkpoint


@pytest.fixture(scope="module")
def remote_checkpoint(tmp_path_factory):
    return build_remote_code_checkpoint(tmp_path_factory.mktemp("remote") / "tinycustom")


def test_remote_code_is_refused_without_opt_in(remote_checkpoint, tmp_path):
    proc = run_cli("run", str(remote_checkpoint), "--output-dir", str(tmp_path), "--device", "cpu")
    assert proc.returncode == 3
    error = [ln for ln in proc.stderr.splitlines() if ln.startswith("migrator: error:")]
    assert len(error) == 1 and "--trust-remote-code" in error[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "tinycustom").exists()


def test_remote_code_is_vendored_with_its_local_modules(remote_checkpoint, tmp_path):
    proc = run_cli("run", str(remote_checkpoint), "--name", "custom", "--output-dir", str(tmp_path),
                   "--device", "cpu", "--trust-remote-code", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    recipe = tmp_path / "custom"
    modeling = (recipe / "models" / "modeling_custom.py").read_text()
    assert (recipe / "models" / "configuration_custom.py").is_file()
    assert (recipe / "models" / "tinycustom_layers.py").is_file()       # local module came along
    assert "from models.tinycustom_layers import" in modeling
    assert "from models.configuration_custom import TinyCustomConfig" in modeling
    assert "from ." not in modeling and "gradient_checkpointing" not in modeling
    assert "runner_settings=None" in modeling and "import torch_npu" in modeling
    baseline = json.loads((recipe / "baseline" / "baseline_metadata.json").read_text())
    parity = baseline["verification"]["parity"]
    assert parity["checked"] and parity["max_abs_logits_diff"] <= 1e-4 and parity["greedy_tokens_equal"]
    report = json.loads((recipe / "migration_report.json").read_text())
    assert report["vendored"]["origin"].startswith("remote code")
