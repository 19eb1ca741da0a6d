"""agent/repair/rules/code.py in-process: each rule's matcher on the evidence of a failed run, and its fix. The
same faults injected into a working recipe and repaired by `migrator run`: tests/e2e/test_repair_code_faults.py;
the codemods the fixes run: tests/unit/agent/codemods/commands/."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agent.repair.failure import Failure
from agent.repair.diagnose import rule_named
from agent.repair.rules.config import key_prefix_mapping
from agent.repair.rules.reports import install_command, pip_distribution
from migrator_cli import first_match_name
from agent.repair.rules.code import npu_kernel_uses

RUNNER = "runner_fi.py"


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


def test_npu_kernel_uses_names_kernels_only():
    source = ("import torch_npu\ntorch.npu.synchronize()\ny = torch_npu.npu_fused_infer_attention_score(q, k, v)\n"
              "z = torch.ops.npu.npu_rms_norm(x)\nfrom torch_npu.contrib import transfer_to_npu\n")
    assert npu_kernel_uses(source) == ["torch.ops.npu", "torch_npu.npu_fused_infer_attention_score"]
    assert npu_kernel_uses("torch.npu.synchronize()\nx = x.npu()\n") == []
