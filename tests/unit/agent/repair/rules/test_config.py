"""agent/repair/rules/config.py in-process: the YAML rules' matchers on sample outputs, and their fixes. The same
faults injected into a working recipe and repaired by `migrator run`: tests/e2e/test_repair_config_faults.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from agent.repair.failure import Failure
from agent.repair.diagnose import rule_named
from agent.repair.rules import config
from migrator_cli import first_match_name as _first_match_name


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


def test_timeout_matcher_needs_a_timeout(tmp_path):
    from agent.repair.failure import Failure

    timeout = rule_named("run_timed_out")
    assert timeout.match(Failure(tmp_path, "x", "ValueError: no", None)) is None
    facts = timeout.match(Failure(tmp_path, "a\nstill decoding\n", "TimeoutError: infer.sh did not finish", None, True))
    assert facts["last_line"] == "still decoding"
