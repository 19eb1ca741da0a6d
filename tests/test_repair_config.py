"""Fault injection: recipe YAML (agent/repair/rules/config.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from migrator_cli import assert_repaired, repair_run

from agent.repair.failure import Failure
from agent.repair.diagnose import rule_named
from agent.repair.rules import config
from migrator_cli import first_match_name as _first_match_name


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


# ---- matchers on sample outputs (no model run) --------------------------------------------
YAML = """\
# fi: single card, eager mode.
model_name: fi
model_path: "{model_path}"
exe_mode: eager
device: cpu
world_size: 1

model_config:
  dtype: float32
  enable_online_split_weight: false
  attn_implementation: sdpa

data_config:
  dataset: default
  input_max_len: 504
  max_new_tokens: 8
  batch_size: 1

parallel_config:
  attn_tp_size: 1
  moe_tp_size: 1
  lmhead_tp_size: 1
"""


@pytest.fixture
def fake_recipe(tmp_path):
    """A recipe YAML and a checkpoint with only config.json (512 positions)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                  "max_position_embeddings": 512, "torch_dtype": "bfloat16"}))
    (ckpt / "model.safetensors").write_bytes(b"")
    recipe = tmp_path / "fi"
    (recipe / "config").mkdir(parents=True)
    (recipe / "config" / "fi_1card_eager.yaml").write_text(YAML.format(model_path=ckpt))
    (recipe / "runner_fi.py").write_text("")
    return recipe


def _launch_error(message: str) -> str:
    return f"engine.launch: error: config/fi_1card_eager.yaml: {message}\n"


def _apply(recipe: Path, name: str, output: str) -> str:
    failure = Failure.from_output(recipe, output)
    rule = rule_named(name)
    return rule.fix(failure, rule.match(failure), None)


def test_missing_key_matcher_and_defaults(fake_recipe):
    path = fake_recipe / "config" / "fi_1card_eager.yaml"
    out = _launch_error("missing required key 'data_config.max_new_tokens'")
    assert _first_match_name(fake_recipe, out) is None                    # the key is there
    path.write_text(path.read_text().replace("  max_new_tokens: 8\n", "").replace("world_size: 1\n", "")
                    .replace("  batch_size: 1\n", ""))
    assert _first_match_name(fake_recipe, out) == "yaml_missing_key"
    _apply(fake_recipe, "yaml_missing_key", out)
    _apply(fake_recipe, "yaml_missing_key", _launch_error("missing required key 'world_size'"))
    _apply(fake_recipe, "yaml_missing_key", _launch_error("missing required key 'data_config.batch_size'"))
    assert path.read_text() == YAML.format(model_path=fake_recipe.parent / "ckpt")
    # a whole section
    path.write_text(path.read_text().split("\nparallel_config:")[0])
    _apply(fake_recipe, "yaml_missing_key", _launch_error("missing required key 'parallel_config'"))
    assert yaml.safe_load(path.read_text())["parallel_config"] == {"attn_tp_size": 1, "moe_tp_size": 1,
                                                                   "lmhead_tp_size": 1}
    assert _first_match_name(fake_recipe, _launch_error("missing required key 'data_config.colour'")) is None


@pytest.mark.parametrize("value, kind, choices, expected", [
    ("32", "int", None, 32), (" 4 ", "int", None, 4), (8.0, "int", None, 8), ("eight", "int", None, None),
    ("0", "int", None, None), (True, "int", None, None),
    ("true", "bool", None, True), ("No", "bool", None, False), (1, "bool", None, True), ("maybe", "bool", None, None),
    ("fp16", "str", ["float32", "float16", "bfloat16"], "float16"),
    ("BF16", "str", ["float32", "float16", "bfloat16"], "bfloat16"),
    ("fp32", "str", ["float32", "float16", "bfloat16"], "float32"),
    ("int8", "str", ["float32", "float16", "bfloat16"], None),
])
def test_coercion_is_only_the_unambiguous_reading(value, kind, choices, expected):
    assert config._coerce("model_config.dtype", value, kind, choices) == expected


def test_wrong_type_matcher_and_fix(fake_recipe):
    path = fake_recipe / "config" / "fi_1card_eager.yaml"
    path.write_text(path.read_text().replace("batch_size: 1", 'batch_size: "1"').replace("dtype: float32", "dtype: fp16")
                    .replace("input_max_len: 504", "input_max_len: 504.0")
                    .replace("exe_mode: eager", "exe_mode: turbo"))
    fixes = {
        "'data_config.batch_size' must be int, got '1' (str)": "  batch_size: 1\n",
        "'model_config.dtype' is 'fp16'; expected one of float32, float16, bfloat16": "  dtype: float16\n",
        "'data_config.input_max_len' must be int, got 504.0 (float)": "  input_max_len: 504\n",
        "'exe_mode' is 'turbo'; expected one of eager, graph": "exe_mode: eager\n",   # no reading: template default
    }
    for message, line in fixes.items():
        assert _first_match_name(fake_recipe, _launch_error(message)) == "yaml_wrong_type"
        _apply(fake_recipe, "yaml_wrong_type", _launch_error(message))
        assert line in path.read_text()
    assert rule_named("yaml_wrong_type").match(Failure.from_output(fake_recipe, "ValueError: something else\n")) is None


def test_model_path_matcher_and_moved_checkpoint(fake_recipe, tmp_path):
    path = fake_recipe / "config" / "fi_1card_eager.yaml"
    out = "OSError: Repo id must be in the form 'repo_name' or 'namespace/repo_name': '/x/ckpt'.\n"
    assert _first_match_name(fake_recipe, out) is None                    # model_path exists
    # the checkpoint moved: tmp/ckpt -> tmp/models/ckpt; the YAML still names tmp/ckpt
    (tmp_path / "models").mkdir()
    (tmp_path / "ckpt").rename(tmp_path / "models" / "ckpt")
    assert _first_match_name(fake_recipe, out) == "model_path_missing"
    before = path.read_bytes()
    note = _apply(fake_recipe, "model_path_missing", out)
    # a checkpoint near the old path may be anyone's: named, never written into the YAML
    assert path.read_bytes() == before
    assert str(tmp_path / "models" / "ckpt") in note and "not chosen for you" in note, note


def test_model_path_nothing_found_changes_nothing(fake_recipe, tmp_path):
    path = fake_recipe / "config" / "fi_1card_eager.yaml"
    (tmp_path / "ckpt" / "config.json").unlink()
    before = path.read_bytes()
    note = _apply(fake_recipe, "model_path_missing", f"OSError: Can't load the configuration of '{tmp_path / 'ckpt'}'\n")
    assert path.read_bytes() == before
    assert "does not exist" in note and "set model_path" in note


def test_lengths_matcher_and_fix(fake_recipe):
    path = fake_recipe / "config" / "fi_1card_eager.yaml"
    out = ("ValueError: data_config.input_max_len (504) + data_config.max_new_tokens (2000) exceeds "
           "max_position_embeddings (512); lower them in the YAML\n")
    assert _first_match_name(fake_recipe, out) == "lengths_exceed_positions"
    _apply(fake_recipe, "lengths_exceed_positions", out)
    data = yaml.safe_load(path.read_text())["data_config"]
    assert data["max_new_tokens"] == 250 and data["input_max_len"] == 262     # 2000 alone exceeds: halved to <= 256
    assert _first_match_name(fake_recipe, "ValueError: max_position_embeddings must be positive\n") is None


def test_device_matcher(fake_recipe):
    path = fake_recipe / "config" / "fi_1card_eager.yaml"
    out = ("engine.environment.DeviceUnavailableError: --device cuda requested but torch 2.6.0+cpu is built "
           "without CUDA; use --device cpu\n")
    assert _first_match_name(fake_recipe, out) is None                    # the YAML says cpu
    path.write_text(path.read_text().replace("device: cpu", "device: cuda"))
    assert _first_match_name(fake_recipe, out) == "device_unavailable"
    _apply(fake_recipe, "device_unavailable", out)
    assert yaml.safe_load(path.read_text())["device"] == "auto"


def test_yaml_missing_matcher(fake_recipe):
    out = _launch_error("YAML file not found")
    assert _first_match_name(fake_recipe, out) is None                    # the YAML is there
    (fake_recipe / "config" / "fi_1card_eager.yaml").unlink()
    assert rule_named("yaml_file_missing").match(Failure.from_output(fake_recipe, out)) == {"file": "config/fi_1card_eager.yaml"}


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


def test_timeout_matcher_needs_a_timeout(tmp_path):
    from agent.repair.failure import Failure

    timeout = rule_named("run_timed_out")
    assert timeout.match(Failure(tmp_path, "x", "ValueError: no", None)) is None
    facts = timeout.match(Failure(tmp_path, "a\nstill decoding\n", "TimeoutError: infer.sh did not finish", None, True))
    assert facts["last_line"] == "still decoding"
