"""Fault injection: recipe code (agent/repair/rules/code.py), plus fast matcher and codemod tests."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from libcst.codemod import CodemodTest

from agent.repair.failure import Failure
from agent.repair.diagnose import rule_named
from agent.codemods.commands.add_forward_kwargs import AddForwardKwargsCommand
from agent.codemods.commands.device_agnostic_cuda import DeviceAgnosticCudaCommand
from agent.codemods.commands.guard_optional_import import GUARD_FLASH_ATTN, GuardOptionalImportCommand
from agent.codemods.commands.pad_token_fallback import PadTokenFallbackCommand
from agent.codemods.commands.trust_remote_code import TrustRemoteCodeCommand
from agent.repair.rules.config import key_prefix_mapping
from agent.repair.rules.reports import install_command, pip_distribution
from migrator_cli import assert_repaired, assert_round_backup, first_match_name, repair_run

MODELING = "models/modeling_fi.py"
RUNNER = "runner_fi.py"


def _edit(path: Path, old: str, new: str, count: int = 1, after: str | None = None) -> None:
    """Replace `old` by `new` in a file (after the first `after`, when given); the text must be there."""
    text = path.read_text()
    start = text.index(after) if after else 0
    assert old in text[start:], (path, old)
    path.write_text(text[:start] + text[start:].replace(old, new, count))


def _added(diff: str) -> list[str]:
    return [ln for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]


def _yaml_file(recipe: Path) -> Path:
    return next((recipe / "config").glob("*.yaml"))


def _model_config(recipe: Path) -> dict:
    return yaml.safe_load(_yaml_file(recipe).read_text())["model_config"]


def _snapshot(recipe: Path) -> dict[str, bytes]:
    return {str(p.relative_to(recipe)): p.read_bytes() for p in sorted(recipe.rglob("*"))
            if p.is_file() and not {".migrator", "res", "baseline", "__pycache__"} & set(p.relative_to(recipe).parts)
            # report artifacts (README.md carries the migration summary between markers)
            and p.name not in ("migration_report.json", "migration_summary.md", "README.md")}


def _assert_run_repaired(recipe: Path, report: dict, rule: str, injected: dict[str, bytes | None]) -> None:
    """assert_repaired without the final status: the repaired recipe runs and its baseline is
    collected (used where agent.measure.parity's check cannot pass for reasons outside the rule)."""
    assert report["scenario"] == "B", report.get("message")
    first = report["rounds"][0]
    assert first["diagnosis"]["rule"] == rule, first["diagnosis"]
    assert first["applied"] and first["diff"]
    trial = [r for r in report["runs"] if r["label"].startswith("trial")][-1]
    assert trial["ok"], trial
    assert (recipe / "baseline" / "baseline_metadata.json").is_file()
    assert_round_backup(recipe, first, injected)


def _assert_reported_unchanged(recipe: Path, before: dict, proc, summary: dict, report: dict, rule: str,
                               message: str) -> None:
    """A report-only rule: exit 1, status failed, the rule named, the message carried, no file changed."""
    assert proc.returncode == 1, (proc.stdout[-1500:], proc.stderr[-2500:])
    assert summary["scenario"] == "B" and summary["status"] == "failed", summary
    first = report["rounds"][0]
    assert first["diagnosis"]["rule"] == rule, first["diagnosis"]
    assert not first["applied"] and not first["diff"]
    assert message in first["note"], first["note"]
    assert message in json.dumps(report)
    assert _snapshot(recipe) == before


@pytest.mark.slow  # end-to-end round; the in-process matcher and fix tests of this rule stay in the default suite
# ---- fault injection ---------------------------------------------------------------------
def test_model_init_without_runner_settings_gets_it_back(working_recipe):
    # In practice: a modeling file copied fresh from transformers over the vendored one.
    modeling = working_recipe / MODELING
    _edit(modeling, '''    def __init__(self, config: LlamaConfig, runner_settings=None, **kwargs):
        r"""
        runner_settings (`dict`, *optional*):
            Recipe settings (the YAML) passed by the engine's ModelRunner.
        """
''', "    def __init__(self, config: LlamaConfig):\n", after="class LlamaForCausalLM")
    injected = {MODELING: modeling.read_bytes()}
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "constructor_without_runner_settings", injected)
    text = modeling.read_text()
    assert text[text.index("class LlamaForCausalLM"):].count(
        "def __init__(self, config: LlamaConfig, runner_settings=None, **kwargs):") == 1
    # Only that signature (and its docstring) changed.
    diff = report["rounds"][0]["diff"]
    assert [ln for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")] == \
        ["-    def __init__(self, config: LlamaConfig):"]


@pytest.mark.slow  # end-to-end round; the in-process matcher and fix tests of this rule stay in the default suite
def test_forward_without_kwargs_accepts_extra_keywords(working_recipe):
    # In practice: a runner written for older transformers passes cache_position, and the
    # vendored forward (as remote/custom code often does) has no **kwargs to take it.
    modeling, runner = working_recipe / MODELING, working_recipe / RUNNER
    _edit(modeling, "        logits_to_keep: int | torch.Tensor = 0,\n        **kwargs: Unpack[TransformersKwargs],\n",
          "        logits_to_keep: int | torch.Tensor = 0,\n", after="class LlamaForCausalLM")
    _edit(modeling, "            use_cache=use_cache,\n            **kwargs,\n", "            use_cache=use_cache,\n",
          after="class LlamaForCausalLM")
    runner.write_text(runner.read_text() + (
        "\n    def model_input_prepare(self, batch):\n"
        "        model_inputs = super().model_input_prepare(batch)\n"
        "        model_inputs[\"cache_position\"] = model_inputs[\"position_ids\"][0]\n"
        "        return model_inputs\n"))
    injected = {MODELING: modeling.read_bytes(), RUNNER: runner.read_bytes()}
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "forward_unexpected_keyword", injected)
    first = report["rounds"][0]
    assert first["diagnosis"]["facts"]["kwarg"] == "cache_position"
    assert "        logits_to_keep: int | torch.Tensor = 0,\n        **kwargs,\n" in modeling.read_text()
    assert runner.read_bytes() == injected[RUNNER]
    assert _added(first["diff"]) == ["+        **kwargs,"]


@pytest.mark.slow  # end-to-end round; test_match_missing_pip_package tests the rule in-process
def test_missing_package_is_reported_with_the_install_line(working_recipe):
    # In practice: modeling code that imports a package this environment lacks.
    if importlib.util.find_spec("einops") is not None:      # the fault needs einops absent
        pytest.skip("einops is installed here")
    modeling = working_recipe / MODELING
    _edit(modeling, "import torch\n", "import einops\nimport torch\n")
    before = _snapshot(working_recipe)
    proc, summary, report = repair_run(working_recipe)
    line = f"{sys.executable} -m pip install einops"
    _assert_reported_unchanged(working_recipe, before, proc, summary, report, "missing_pip_package", line)
    assert report["rounds"][0]["diagnosis"]["facts"]["install"] == line


def _tiny_wheel(dist_dir: Path, name: str) -> Path:
    """A minimal pure-Python wheel (no build backend, no network)."""
    dist_dir.mkdir(parents=True, exist_ok=True)
    wheel = dist_dir / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    files = {f"{name}/__init__.py": "VALUE = 42\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as zf:
        for arcname, text in files.items():
            zf.writestr(arcname, text)
    return wheel


@pytest.mark.slow  # end-to-end round; the in-process matcher and fix tests of this rule stay in the default suite
def test_missing_package_is_installed_with_allow_install(working_recipe, tmp_path):
    # The install path for real, offline: pip finds the package in a local wheel folder and
    # installs into a target folder on PYTHONPATH (the shared environment stays untouched).
    name = "fi_tiny_dep"
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    _tiny_wheel(wheels, name)
    site.mkdir()
    modeling = working_recipe / MODELING
    _edit(modeling, "import torch\n", f"import torch\nimport {name}\n")
    requirements = working_recipe / "requirements.txt"
    injected = {MODELING: modeling.read_bytes(), "requirements.txt": requirements.read_bytes()}
    env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "PIP_TARGET": str(site),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONPATH": str(site)}
    from migrator_cli import run_cli

    run_cli("run", str(working_recipe), "--json", "--allow-install", env=env)
    report = json.loads((working_recipe / "migration_report.json").read_text())
    # Not assert_repaired: agent.measure.parity runs the recipe with PYTHONPATH=<recipe> only, so it cannot
    # see this test's target folder (a real install goes to site-packages, where it can).
    _assert_run_repaired(working_recipe, report, "missing_pip_package", injected)
    assert (site / name / "__init__.py").is_file()
    assert requirements.read_text().endswith(f"\n{name}\n")
    assert modeling.read_bytes() == injected[MODELING]


@pytest.mark.slow  # end-to-end round; the in-process matcher and fix tests of this rule stay in the default suite
def test_unguarded_flash_attn_import_is_guarded(working_recipe):
    # In practice: vendored code edited on a GPU box with flash-attn installed. (A YAML with
    # flash_attention_2 is refused by engine.launch before any import; the rule's YAML edit is
    # covered by the matcher test.)
    modeling, yaml_file = working_recipe / MODELING, _yaml_file(working_recipe)
    _edit(modeling, "from torch import nn\n", "from torch import nn\nfrom flash_attn import flash_attn_func\n")
    injected = {MODELING: modeling.read_bytes()}
    yaml_before = yaml_file.read_bytes()
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "flash_attn_not_installed", injected)
    assert ("try:\n    from flash_attn import flash_attn_func\nexcept ImportError:"
            in modeling.read_text())
    assert "    flash_attn_func = None\n" in modeling.read_text()
    assert yaml_file.read_bytes() == yaml_before


@pytest.mark.slow  # end-to-end round; TestDeviceAgnosticCudaCommand tests the codemod in-process
def test_hardcoded_cuda_is_made_device_agnostic(working_recipe):
    # In practice: vendored code edited on a GPU box (.cuda(), torch.cuda.synchronize for timing).
    modeling = working_recipe / MODELING
    _edit(modeling, "        causal_mask = create_causal_mask(\n",
          "        position_ids = position_ids.cuda()\n        torch.cuda.synchronize()\n"
          "        causal_mask = create_causal_mask(\n", after="class LlamaModel")
    injected = {MODELING: modeling.read_bytes()}
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "hardcoded_cuda_device", injected)
    text = modeling.read_text()
    assert "position_ids = position_ids.to(self.device)\n        _recipe_synchronize()\n        causal_mask" in text
    assert ".cuda()" not in text and "        torch.cuda.synchronize()\n" not in text
    assert "def _recipe_synchronize():" in text and "def _recipe_device():" in text


@pytest.mark.slow  # end-to-end round; the in-process matcher and fix tests of this rule stay in the default suite
def test_renamed_base_model_gets_a_key_mapping(working_recipe):
    # In practice: vendored code whose base model attribute was renamed (model -> transformer).
    modeling = working_recipe / MODELING
    _edit(modeling, 'base_model_prefix = "model"', 'base_model_prefix = "transformer"',
          after="class LlamaPreTrainedModel")
    _edit(modeling, '"model.embed_tokens.weight"', '"transformer.embed_tokens.weight"', after="class LlamaForCausalLM")
    _edit(modeling, "self.model = LlamaModel(config)", "self.transformer = LlamaModel(config)",
          after="class LlamaForCausalLM")
    _edit(modeling, "= self.model(", "= self.transformer(", after="class LlamaForCausalLM")
    yaml_file = _yaml_file(working_recipe)
    injected = {MODELING: modeling.read_bytes(), str(yaml_file.relative_to(working_recipe)): yaml_file.read_bytes()}
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "state_dict_key_mismatch", injected)
    assert _model_config(working_recipe)["key_mapping"] == {r"^model\.": "transformer."}
    assert modeling.read_bytes() == injected[MODELING]


@pytest.mark.slow  # end-to-end round; the in-process matcher and fix tests of this rule stay in the default suite
def test_checkpoint_with_tied_embeddings_gets_config_override(working_recipe, tmp_path):
    # In practice: a checkpoint saved with tied embeddings (no lm_head in the safetensors) whose
    # config.json says tie_word_embeddings: false.
    from safetensors.torch import load_file, save_file

    from agent.testing.tiny_checkpoint import build_tiny_checkpoint

    checkpoint = build_tiny_checkpoint("llama", tmp_path / "tied")
    weights = checkpoint / "model.safetensors"
    tensors = load_file(weights)
    tensors.pop("lm_head.weight")
    save_file(tensors, weights, metadata={"format": "pt"})
    assert json.loads((checkpoint / "config.json").read_text()).get("tie_word_embeddings") is False
    yaml_file = _yaml_file(working_recipe)
    old_path = yaml.safe_load(yaml_file.read_text())["model_path"]
    _edit(yaml_file, f'model_path: {old_path}', f'model_path: "{checkpoint}"')
    rel_yaml = str(yaml_file.relative_to(working_recipe))
    injected = {rel_yaml: yaml_file.read_bytes()}
    proc, summary, report = repair_run(working_recipe)
    # Not assert_repaired: agent.measure.parity's reference model is loaded from config.json without the
    # recipe's config_overrides, so transformers itself gives it a random lm_head.
    _assert_run_repaired(working_recipe, report, "state_dict_key_mismatch", injected)
    assert _model_config(working_recipe)["config_overrides"] == {"tie_word_embeddings": True}


CUSTOM_CONFIGURATION = '''\
from transformers import LlamaConfig


class CustomLlamaConfig(LlamaConfig):
    """A Llama variant shipped as custom code (as many Hub repos do)."""

    model_type = "customllama"
'''
CUSTOM_MODELING = '''\
from transformers import LlamaForCausalLM

from .configuration_custom import CustomLlamaConfig


class CustomLlamaForCausalLM(LlamaForCausalLM):
    config_class = CustomLlamaConfig
'''


def _remote_code_recipe(recipe: Path, tmp_path: Path) -> Path:
    """The recipe's checkpoint turned into an `auto_map` one, and a runner that reads its config
    with AutoConfig (no trust_remote_code) after loading the model."""
    yaml_file = _yaml_file(recipe)
    old_path = yaml.safe_load(yaml_file.read_text())["model_path"]
    checkpoint = tmp_path / "custom_ckpt"
    shutil.copytree(old_path, checkpoint)
    (checkpoint / "configuration_custom.py").write_text(CUSTOM_CONFIGURATION)
    (checkpoint / "modeling_custom.py").write_text(CUSTOM_MODELING)
    config = json.loads((checkpoint / "config.json").read_text())
    config["model_type"] = "customllama"      # unknown to transformers: only the repo's code has it
    config["auto_map"] = {"AutoConfig": "configuration_custom.CustomLlamaConfig",
                          "AutoModelForCausalLM": "modeling_custom.CustomLlamaForCausalLM"}
    (checkpoint / "config.json").write_text(json.dumps(config, indent=2))
    _edit(yaml_file, f'model_path: {old_path}', f'model_path: "{checkpoint}"')
    runner = recipe / RUNNER
    _edit(runner, "from engine.model_runner import ModelRunner\n",
          "from engine.model_runner import ModelRunner\nfrom transformers import AutoConfig\n")
    _edit(runner, "    config_class = LlamaConfig\n",
          "    config_class = LlamaConfig\n\n"
          "    def init_model(self):\n"
          "        super().init_model()\n"
          "        self.hf_config = AutoConfig.from_pretrained(self.model_path)\n")
    return runner


def test_remote_code_without_opt_in_is_reported(working_recipe, tmp_path):
    _remote_code_recipe(working_recipe, tmp_path)
    before = _snapshot(working_recipe)
    proc, summary, report = repair_run(working_recipe)
    _assert_reported_unchanged(working_recipe, before, proc, summary, report, "remote_code_needs_trust",
                               "re-run with --trust-remote-code after reviewing the code")
    assert report["rounds"][0]["diagnosis"]["facts"]["file"] == RUNNER


@pytest.mark.slow  # end-to-end round; the in-process matcher and fix tests of this rule stay in the default suite
def test_remote_code_with_opt_in_patches_the_call(working_recipe, tmp_path):
    runner = _remote_code_recipe(working_recipe, tmp_path)
    injected = {RUNNER: runner.read_bytes()}
    proc, summary, report = repair_run(working_recipe, "--trust-remote-code")
    assert_repaired(working_recipe, proc, summary, report, "remote_code_needs_trust", injected)
    assert "self.hf_config = AutoConfig.from_pretrained(self.model_path, trust_remote_code=True)\n" \
        in runner.read_text()
    assert _added(report["rounds"][0]["diff"]) == [
        "+        self.hf_config = AutoConfig.from_pretrained(self.model_path, trust_remote_code=True)"]


@pytest.mark.slow  # end-to-end round; the in-process matcher test of this rule stays in the default suite
def test_tokenizer_without_pad_token_falls_back_to_eos(working_recipe, tmp_path):
    # In practice: a runner that reloads the tokenizer itself, a checkpoint without a pad token,
    # and a batch of 2 prompts (padding needed).
    yaml_file = _yaml_file(working_recipe)
    old_path = yaml.safe_load(yaml_file.read_text())["model_path"]
    checkpoint = tmp_path / "nopad_ckpt"
    shutil.copytree(old_path, checkpoint)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = checkpoint / name
        if path.is_file():
            data = json.loads(path.read_text())
            data.pop("pad_token", None)
            path.write_text(json.dumps(data, indent=2))
    _edit(yaml_file, f'model_path: {old_path}', f'model_path: "{checkpoint}"')
    _edit(yaml_file, "batch_size: 1", "batch_size: 2")
    runner = working_recipe / RUNNER
    _edit(runner, "from engine.model_runner import ModelRunner\n",
          "from engine.model_runner import ModelRunner\nfrom transformers import AutoTokenizer\n")
    _edit(runner, "    config_class = LlamaConfig\n",
          "    config_class = LlamaConfig\n\n"
          "    def init_model(self):\n"
          "        super().init_model()\n"
          "        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)\n"
          "        self.tokenizer.padding_side = \"left\"\n")
    injected = {RUNNER: runner.read_bytes()}
    proc, summary, report = repair_run(working_recipe)
    assert_repaired(working_recipe, proc, summary, report, "tokenizer_without_pad_token", injected)
    assert ("        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)\n"
            "        if self.tokenizer.pad_token is None:") in runner.read_text()
    assert "            self.tokenizer.pad_token = self.tokenizer.eos_token\n" in runner.read_text()


# ---- matchers (no model run) ----------------------------------------------------------------
def _traceback(recipe: Path, frames: list[tuple[str, int]], error: str) -> str:
    lines = ["Traceback (most recent call last):"]
    for rel, line in frames:
        lines += [f'  File "{recipe / rel if not rel.startswith("/") else rel}", line {line}, in f', "    x()"]
    return "\n".join([*lines, error]) + "\n"


MODEL_SRC = '''\
import torch
from torch import nn


class FooPreTrainedModel(PreTrainedModel):
    base_model_prefix = "model"


class FooForCausalLM(FooPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)

    def forward(self, input_ids, position_ids=None):
        return input_ids
'''
RUNNER_SRC = '''\
from transformers import AutoConfig, AutoTokenizer


class FooRunner(ModelRunner):
    def init_model(self):
        super().init_model(FooForCausalLM, FooConfig)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.cfg = AutoConfig.from_pretrained(self.model_path)
'''
YAML_SRC = '''\
model_name: foo
model_path: "{path}"
model_config:
  dtype: float32
  attn_implementation: flash_attention_2
data_config:
  batch_size: 1
'''


@pytest.fixture
def fake_recipe(tmp_path):
    recipe = tmp_path / "foo"
    (recipe / "models").mkdir(parents=True)
    (recipe / "config").mkdir()
    (recipe / "models" / "modeling_foo.py").write_text(MODEL_SRC)
    (recipe / RUNNER.replace("fi", "foo")).write_text(RUNNER_SRC)
    (recipe / "config" / "foo.yaml").write_text(YAML_SRC.format(path=tmp_path / "ckpt"))
    return recipe


def test_match_constructor_without_runner_settings(fake_recipe):
    out = _traceback(fake_recipe, [("runner_foo.py", 6)],
                     "TypeError: FooForCausalLM.__init__() got an unexpected keyword argument 'runner_settings'")
    assert first_match_name(fake_recipe, out) == "constructor_without_runner_settings"
    # Another keyword, or a class the recipe does not define: not this rule.
    assert first_match_name(fake_recipe, out.replace("'runner_settings'", "'foo'")) is None
    assert first_match_name(fake_recipe, out.replace("FooForCausalLM.__init__", "BarModel.__init__")) is None


def test_match_forward_unexpected_keyword(fake_recipe):
    out = _traceback(fake_recipe, [("runner_foo.py", 6)],
                     "TypeError: FooForCausalLM.forward() got an unexpected keyword argument 'cache_position'")
    facts = rule_named("forward_unexpected_keyword").match(Failure.from_output(fake_recipe, out))
    assert facts == {"class": "FooForCausalLM", "method": "forward", "kwarg": "cache_position",
                     "file": "models/modeling_foo.py"}
    # forward already takes **kwargs: adding it again cannot help.
    modeling = fake_recipe / "models" / "modeling_foo.py"
    modeling.write_text(MODEL_SRC.replace("position_ids=None)", "position_ids=None, **kwargs)"))
    assert first_match_name(fake_recipe, out) is None


def test_match_flash_attn_before_missing_package(fake_recipe):
    modeling = fake_recipe / "models" / "modeling_foo.py"
    modeling.write_text("from flash_attn import flash_attn_func\n" + MODEL_SRC)
    out = _traceback(fake_recipe, [("models/modeling_foo.py", 1)], "ModuleNotFoundError: No module named 'flash_attn'")
    rule = rule_named("flash_attn_not_installed")
    assert first_match_name(fake_recipe, out) == "flash_attn_not_installed"
    assert rule.match(Failure.from_output(fake_recipe, out)) == {"files": ["models/modeling_foo.py"],
                                                       "attn_implementation": "flash_attention_2", "set_sdpa": True}
    # Other missing modules are not flash_attn's business.
    assert rule.match(Failure.from_output(fake_recipe, out.replace("flash_attn'", "einops'"))) is None


def test_match_missing_pip_package(fake_recipe):
    out = _traceback(fake_recipe, [("models/modeling_foo.py", 1)],
                     "ModuleNotFoundError: No module named 'sklearn'")
    rule = rule_named("missing_pip_package")
    facts = rule.match(Failure.from_output(fake_recipe, out))
    if facts is not None:       # (scikit-learn happens not to be installed)
        assert facts["install"] == f"{sys.executable} -m pip install scikit-learn"
    assert rule.match(Failure.from_output(fake_recipe, out.replace("sklearn", "fi_not_a_real_module_xyz")))["install"] == \
        f"{sys.executable} -m pip install fi_not_a_real_module_xyz"
    # Recipe-local modules, the engine, and submodules of installed packages are not pip's.
    for module in ("models.modeling_bar", "runner_bar", "engine.launch", "transformers.models.foo_bar", "torch.foo"):
        assert rule.match(Failure.from_output(fake_recipe, out.replace("sklearn", module))) is None, module
    (fake_recipe / "helpers.py").write_text("")
    assert rule.match(Failure.from_output(fake_recipe, out.replace("sklearn", "helpers"))) is None


def test_pip_distribution_names():
    assert pip_distribution("yaml") == "pyyaml"
    assert pip_distribution("PIL.Image") == "pillow"
    assert pip_distribution("google.protobuf.message") == "protobuf"
    assert pip_distribution("cv2") == "opencv-python"
    assert pip_distribution("sklearn.linear_model") == "scikit-learn"
    assert pip_distribution("einops.layers.torch") == "einops"
    assert pip_distribution("somepkg.sub") == "somepkg"
    assert install_command("pyyaml") == f"{sys.executable} -m pip install pyyaml"


def test_match_hardcoded_cuda(fake_recipe):
    out = _traceback(fake_recipe, [("models/modeling_foo.py", 14)],
                     "AssertionError: Torch not compiled with CUDA enabled")
    assert first_match_name(fake_recipe, out) is None            # no hard-coded CUDA in the code
    modeling = fake_recipe / "models" / "modeling_foo.py"
    modeling.write_text(MODEL_SRC.replace("return input_ids", "return input_ids.cuda()"))
    assert first_match_name(fake_recipe, out) == "hardcoded_cuda_device"
    # A CUDA-looking error that is not about a missing CUDA device.
    assert first_match_name(fake_recipe, out.replace("Torch not compiled with CUDA enabled",
                                               "CUDA error: device-side assert triggered")) is None


def _state_dict_error(path: Path, missing: list, unexpected: list, shapes: list = ()) -> str:
    return (f"RuntimeError: state dict mismatch loading {path}: missing keys {sorted(missing)[:8]}, "
            f"unexpected keys {sorted(unexpected)[:8]}, mismatched shapes {list(shapes)}")


def test_match_state_dict_prefix(fake_recipe):
    layers = ["embed_tokens.weight", "layers.0.mlp.up_proj.weight", "layers.0.self_attn.q_proj.weight", "norm.weight"]
    error = _state_dict_error(fake_recipe / "ckpt", [f"transformer.{k}" for k in layers], [f"model.{k}" for k in layers])
    rule = rule_named("state_dict_key_mismatch")
    assert rule.match(Failure.from_output(fake_recipe, _traceback(fake_recipe, [], error))) == \
        {"fix": "key_mapping", "key_mapping": {r"^model\.": "transformer."}}
    # Missing and unexpected keys that are not one prefix apart; mismatched shapes.
    odd = _state_dict_error(fake_recipe / "ckpt", ["transformer.norm.weight", "lm_head.weight"],
                            ["model.norm.weight", "model.final.bias"])
    assert rule.match(Failure.from_output(fake_recipe, _traceback(fake_recipe, [], odd))) is None
    shapes = _state_dict_error(fake_recipe / "ckpt", [], [], ["lm_head.weight: [10, 4] vs [12, 4]"])
    assert rule.match(Failure.from_output(fake_recipe, _traceback(fake_recipe, [], shapes))) is None


def test_key_prefix_mapping():
    assert key_prefix_mapping(["transformer.h.0.w", "transformer.wte.weight"],
                              ["model.h.0.w", "model.wte.weight"]) == {r"^model\.": "transformer."}
    assert key_prefix_mapping(["layers.0.w.weight"], ["model.layers.0.w.weight"]) == {r"^model\.": ""}
    assert key_prefix_mapping(["model.layers.0.w.weight"], ["layers.0.w.weight"]) == {"^": "model."}
    assert key_prefix_mapping(["a.x.weight", "b.y.weight"], ["c.x.weight", "d.y.weight"]) is None
    assert key_prefix_mapping(["lm_head.weight"], []) is None


def test_match_state_dict_tied_embeddings(fake_recipe):
    from safetensors.torch import save_file
    import torch

    checkpoint = fake_recipe.parent / "ckpt"
    checkpoint.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, checkpoint / "model.safetensors")
    error = _state_dict_error(checkpoint, ["lm_head.weight"], [])
    rule = rule_named("state_dict_key_mismatch")
    assert rule.match(Failure.from_output(fake_recipe, _traceback(fake_recipe, [], error))) == \
        {"fix": "tie_word_embeddings", "config_overrides": {"tie_word_embeddings": True}}
    # The checkpoint has no embedding to tie to (lm_head just missing): not this fix.
    save_file({"model.norm.weight": torch.zeros(2)}, checkpoint / "model.safetensors")
    assert rule.match(Failure.from_output(fake_recipe, _traceback(fake_recipe, [], error))) is None


def test_match_remote_code(fake_recipe):
    error = ("ValueError: The repository /x contains custom code which must be executed to correctly load the "
             "model. You can inspect the repository content at /x .")
    out = _traceback(fake_recipe, [("infer.py", 3), ("runner_foo.py", 8), ("/usr/lib/transformers/auto.py", 9)],
                     error)
    rule = rule_named("remote_code_needs_trust")
    assert rule.match(Failure.from_output(fake_recipe, out)) == {"file": "runner_foo.py", "line": 8}
    assert first_match_name(fake_recipe, out) == "remote_code_needs_trust"
    # The line is not a from_pretrained call: nothing to patch.
    assert rule.match(Failure.from_output(fake_recipe, out.replace("line 8", "line 6"))) is None
    assert rule.match(Failure.from_output(fake_recipe, out.replace("contains custom code", "contains odd code"))) is None


def test_remote_code_fix_reports_without_opt_in(fake_recipe):
    from agent.repair.rules.rule import RepairContext

    rule = rule_named("remote_code_needs_trust")
    failure = Failure(fake_recipe, "", "", None)
    note = rule.fix(failure, {"file": "runner_foo.py", "line": 8}, RepairContext())
    assert "re-run with --trust-remote-code after reviewing the code" in note
    assert (fake_recipe / "runner_foo.py").read_text() == RUNNER_SRC
    rule.fix(failure, {"file": "runner_foo.py", "line": 8}, RepairContext(trust_remote_code=True))
    assert "AutoConfig.from_pretrained(self.model_path, trust_remote_code=True)" in \
        (fake_recipe / "runner_foo.py").read_text()


def test_match_tokenizer_without_pad_token(fake_recipe):
    out = _traceback(fake_recipe, [("runner_foo.py", 7)],
                     "ValueError: Asking to pad but the tokenizer does not have a padding token. Please select a "
                     "token to use as `pad_token` `(tokenizer.pad_token = tokenizer.eos_token e.g.)` or add a new "
                     "pad token via `tokenizer.add_special_tokens({'pad_token': '[PAD]'})`.")
    assert first_match_name(fake_recipe, out) == "tokenizer_without_pad_token"
    # The engine's own tokenizer loading (load_tokenizer) already has the fallback: nothing to patch.
    (fake_recipe / "runner_foo.py").write_text(RUNNER_SRC.replace(
        "        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)\n", ""))
    assert first_match_name(fake_recipe, out) is None


# ---- codemods ------------------------------------------------------------------------------
class TestAddForwardKwargsCommand(CodemodTest):
    TRANSFORM = AddForwardKwargsCommand

    def test_noop_when_forward_has_kwargs(self) -> None:
        code = """
            class FooForCausalLM(nn.Module):
                def forward(self, input_ids, **kwargs):
                    return input_ids
        """
        self.assertCodemod(code, code, class_name="FooForCausalLM")

    def test_only_the_named_class(self) -> None:
        before = """
            class FooModel(nn.Module):
                def forward(self, input_ids):
                    return input_ids

            class FooForCausalLM(nn.Module):
                def forward(self, input_ids, logits_to_keep: int = 0):
                    return input_ids
        """
        after = """
            class FooModel(nn.Module):
                def forward(self, input_ids):
                    return input_ids

            class FooForCausalLM(nn.Module):
                def forward(self, input_ids, logits_to_keep: int = 0, **kwargs):
                    return input_ids
        """
        self.assertCodemod(before, after, class_name="FooForCausalLM")

    def test_one_parameter_per_line_and_keyword_only(self) -> None:
        before = """
            class FooForCausalLM(nn.Module):
                def forward(
                    self,
                    input_ids,
                    *,
                    cache=None,
                ):
                    def forward(x):
                        return x
                    return input_ids
        """
        after = """
            class FooForCausalLM(nn.Module):
                def forward(
                    self,
                    input_ids,
                    *,
                    cache=None,
                    **kwargs,
                ):
                    def forward(x):
                        return x
                    return input_ids
        """
        self.assertCodemod(before, after, class_name="FooForCausalLM")


class TestGuardFlashAttnImportCommand(CodemodTest):
    TRANSFORM = GuardOptionalImportCommand

    def test_noop_when_guarded_or_absent(self) -> None:
        code = """
            import torch
            try:
                from flash_attn import flash_attn_func
            except ImportError:
                flash_attn_func = None
        """
        self.assertCodemod(code, code, **GUARD_FLASH_ATTN)

    def test_guards_module_and_function_level_imports(self) -> None:
        before = """
            import torch
            from flash_attn import flash_attn_func, flash_attn_varlen_func as varlen
            import flash_attn.bert_padding


            def pad(x):
                from flash_attn.bert_padding import pad_input
                return pad_input(x)
        """
        after = """
            import torch
            try:
                from flash_attn import flash_attn_func, flash_attn_varlen_func as varlen
            except ImportError:  # flash_attn is optional: use another attn_implementation
                flash_attn_func = varlen = None
            try:
                import flash_attn.bert_padding
            except ImportError:  # flash_attn is optional: use another attn_implementation
                flash_attn = None


            def pad(x):
                try:
                    from flash_attn.bert_padding import pad_input
                except ImportError:  # flash_attn is optional: use another attn_implementation
                    pad_input = None
                return pad_input(x)
        """
        self.assertCodemod(before, after, **GUARD_FLASH_ATTN)


class TestDeviceAgnosticCudaCommand(CodemodTest):
    TRANSFORM = DeviceAgnosticCudaCommand

    def test_noop_without_hardcoded_cuda(self) -> None:
        code = """
            import torch


            def f(x):
                if x.device.type == "cuda" and torch.cuda.is_available():
                    return x.to(x.device)
                return x
        """
        self.assertCodemod(code, code)

    def test_model_method_uses_self_device(self) -> None:
        before = """
            import torch


            class FooModel(FooPreTrainedModel):
                def forward(self, position_ids):
                    position_ids = position_ids.cuda()
                    mask = torch.ones(3, device="cuda:0")
                    return mask.to("cuda"), torch.device("cuda")
        """
        after = """
            import torch


            class FooModel(FooPreTrainedModel):
                def forward(self, position_ids):
                    position_ids = position_ids.to(self.device)
                    mask = torch.ones(3, device=self.device)
                    return mask.to(self.device), self.device
        """
        self.assertCodemod(before, after)

    def test_hidden_states_device_and_non_blocking(self) -> None:
        before = """
            class FooAttention(nn.Module):
                def forward(self, hidden_states, mask):
                    return mask.cuda(non_blocking=True)
        """
        after = """
            class FooAttention(nn.Module):
                def forward(self, hidden_states, mask):
                    return mask.to(hidden_states.device, non_blocking=True)
        """
        self.assertCodemod(before, after)

    def test_helpers_added_for_free_functions_and_synchronize(self) -> None:
        before = '''
            """Doc."""
            import torch

            SCALE = 2


            def rope(t):
                torch.cuda.synchronize()
                return t.cuda(torch.cuda.current_device())
        '''
        after = '''
            """Doc."""
            import torch
            import functools
            import os

            SCALE = 2


            @functools.lru_cache(maxsize=None)
            def _recipe_device():
                """The device this recipe runs on (replaces hard-coded CUDA; RECIPE_DEVICE overrides)."""
                from engine.environment import select_device

                return select_device(os.environ.get("RECIPE_DEVICE", "auto"))


            def _recipe_synchronize():
                """Wait for the recipe device's queued work (replaces torch.cuda.synchronize())."""
                from engine.environment import synchronize

                synchronize(_recipe_device())


            def rope(t):
                _recipe_synchronize()
                return t.to(_recipe_device())
        '''
        self.assertCodemod(before, after)


class TestTrustRemoteCodeCommand(CodemodTest):
    TRANSFORM = TrustRemoteCodeCommand

    def test_noop_on_a_line_without_from_pretrained(self) -> None:
        code = """
            config = AutoConfig.from_pretrained(path)
            model = build(config)
        """
        self.assertCodemod(code, code, line=2)

    def test_adds_the_keyword_on_that_line_only(self) -> None:
        before = """
            config = AutoConfig.from_pretrained(path)
            other = AutoConfig.from_pretrained(path)
        """
        after = """
            config = AutoConfig.from_pretrained(path, trust_remote_code=True)
            other = AutoConfig.from_pretrained(path)
        """
        self.assertCodemod(before, after, line=1)

    def test_multiline_call_and_explicit_false(self) -> None:
        before = """
            tok = AutoTokenizer.from_pretrained(
                path,
                use_fast=True,
            )
            cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)
        """
        after = """
            tok = AutoTokenizer.from_pretrained(
                path,
                use_fast=True,
                trust_remote_code=True,
            )
            cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)
        """
        self.assertCodemod(before, after, line=3)
        self.assertCodemod(
            "cfg = AutoConfig.from_pretrained(path, trust_remote_code=False)\n",
            "cfg = AutoConfig.from_pretrained(path, trust_remote_code=True)\n", line=1)


class TestPadTokenFallbackCommand(CodemodTest):
    TRANSFORM = PadTokenFallbackCommand

    def test_noop_when_fallback_present_or_no_tokenizer(self) -> None:
        code = """
            class R:
                def init_model(self):
                    self.config = AutoConfig.from_pretrained(self.model_path)
                    self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
                    if self.tokenizer.pad_token is None:
                        self.tokenizer.pad_token = self.tokenizer.eos_token
        """
        self.assertCodemod(code, code)

    def test_fallback_after_the_load(self) -> None:
        before = """
            tokenizer = LlamaTokenizerFast.from_pretrained(path)
            print(tokenizer)
        """
        after = """
            tokenizer = LlamaTokenizerFast.from_pretrained(path)
            if tokenizer.pad_token is None:  # batches need padding: pad with EOS (masked out)
                tokenizer.pad_token = tokenizer.eos_token
            print(tokenizer)
        """
        self.assertCodemod(before, after)
