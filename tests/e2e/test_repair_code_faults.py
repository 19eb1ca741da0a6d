"""Fault injection into recipe code (agent/repair/rules/code.py): a working recipe broken as people break it,
`migrator run RECIPE` repairs it in a round (or reports it unchanged), the round's backup holds the injected
bytes. The rules' matchers and fixes in-process: tests/unit/agent/repair/rules/test_code.py."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from migrator_cli import assert_repaired, assert_round_backup, repair_run


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
