"""Fault injection: recipe YAML (agent/repair_rules/config.py)."""

from __future__ import annotations

from conftest import assert_repaired, repair_run


def test_dtype_the_device_cannot_run_is_set_to_float32(working_recipe, monkeypatch):
    # In practice: a recipe written for NPU (float16) run on a CPU that lacks a half kernel.
    # The tiny model runs float16 on CPU, so the fault is the kernel error an older torch raises.
    yaml_file = next((working_recipe / "config").glob("*.yaml"))
    yaml_file.write_text(yaml_file.read_text().replace("dtype: float32", "dtype: float16"))
    runner = working_recipe / "runner_fi.py"
    runner.write_text(runner.read_text().replace(
        "    def model_input_prepare(self, input_dict):\n",
        "    def model_input_prepare(self, input_dict):\n"
        "        if self.dtype == torch.float16 and self.device.type == 'cpu':\n"
        "            raise RuntimeError('\"addmm_impl_cpu_\" not implemented for \\'Half\\'')\n"))
    injected = {str(yaml_file.relative_to(working_recipe)): yaml_file.read_bytes()}
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "dtype_unsupported_on_device", injected)
    assert "dtype: float32" in yaml_file.read_text()
