"""agent/migrate/vendor.py: the codemod sequence vendoring runs and the imports it follows, and a run of it
over real transformers modeling files (pruned to the model's roots, run against transformers). The
commands' own before/after tests: tests/unit/agent/codemods/commands/."""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from pathlib import Path

import libcst as cst
import pytest
from libcst.codemod import CodemodContext

from agent.codemods.commands.absolute_imports import AbsoluteImportsCommand
from agent.codemods.commands.prune_unreachable_definitions import PruneUnreachableDefinitionsCommand
from agent.codemods.commands.remove_gradient_checkpointing import RemoveGradientCheckpointingCommand
from agent.codemods.commands.remove_labels_loss import RemoveLabelsLossCommand
from agent.codemods.commands.runner_settings_init import RunnerSettingsInitCommand
from agent.codemods.commands.torch_npu_guard import TorchNpuImportGuardCommand
from agent.codemods.commands.transformers_init_weights import TransformersInitWeightsCommand
from agent.codemods.commands.vendored_imports import VendoredImportsCommand
from agent.codemods.driver import name_of
from agent.migrate.vendor import (apply_codemods, find_model_class_imports, transformers_model_imports,
                                  vendoring_commands)
from codemod_inputs import GUARD, PACKAGE, SIBLINGS


def test_transformers_model_imports_skips_auto_and_non_model_modules() -> None:
    source = """
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.auto.modeling_auto import AutoModel
from transformers.models.auto import AutoConfig
from transformers.modeling_utils import PreTrainedModel
from models.configuration_x import XConfig
def f():
    from transformers.models.llama.configuration_llama import LlamaConfig, rope_default
    from transformers.models.llama4.modeling_llama4 import *
"""
    assert transformers_model_imports(source) == {
        "transformers.models.llama.configuration_llama": ["LlamaConfig", "rope_default"],
        "transformers.models.llama4.modeling_llama4": [],
    }


def test_vendoring_sequence() -> None:
    names = [name_of(c) for c in vendoring_commands(PACKAGE, SIBLINGS, runs_model=True)]
    assert names == [
        "AbsoluteImportsCommand",
        "RunnerSettingsInitCommand",
        "TorchNpuImportGuardCommand",
        "RemoveGradientCheckpointingCommand",
        "RemoveLabelsLossCommand",
        "TransformersInitWeightsCommand",
    ]
    assert "TorchNpuImportGuardCommand" not in [name_of(c) for c in vendoring_commands(PACKAGE, SIBLINGS, False)]
    assert all(c.DESCRIPTION and "\n" not in c.DESCRIPTION
               for c in [RunnerSettingsInitCommand, AbsoluteImportsCommand, TorchNpuImportGuardCommand,
                         RemoveGradientCheckpointingCommand, RemoveLabelsLossCommand, TransformersInitWeightsCommand,
                         PruneUnreachableDefinitionsCommand, VendoredImportsCommand])


def test_apply_codemods_reports_changed_codemods() -> None:
    code, applied = apply_codemods("from .configuration_llama import LlamaConfig\n", PACKAGE, SIBLINGS)
    assert code.startswith("from models.configuration_my_model import LlamaConfig\n")
    assert applied == ["AbsoluteImportsCommand", "TorchNpuImportGuardCommand"]
    _, applied = apply_codemods("from .configuration_llama import LlamaConfig\n", PACKAGE, SIBLINGS, runs_model=False)
    assert applied == ["AbsoluteImportsCommand"]


def test_find_model_class_imports_flags_models_and_configs_only() -> None:
    source = """
from transformers.models.llama.modeling_llama import LlamaModel, rotate_half
from transformers.models.llama.configuration_llama import LlamaConfig
from transformers.models.auto import AutoModel, AutoConfig
from transformers.modeling_utils import PreTrainedModel
from transformers.configuration_utils import PreTrainedConfig
def f():
    from transformers.models.mistral.configuration_mistral import MistralConfig
"""
    # A configuration class of another model is its implementation too (exaone -> llama's
    # config slipped through); AutoConfig is the registry, not a configuration class.
    assert find_model_class_imports(source) == [
        "transformers.models.llama.modeling_llama.LlamaModel",
        "transformers.models.llama.configuration_llama.LlamaConfig",
        "transformers.models.auto.AutoModel",
        "transformers.models.mistral.configuration_mistral.MistralConfig",
    ]
    assert find_model_class_imports("from transformers.models.auto import AutoConfig\n") == []


# ----------------------------------------------------------------------------------------
# Real modeling files
# ----------------------------------------------------------------------------------------

MODEL_TYPES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3", "gpt_neox", "olmo2",
               "qwen2_moe", "mixtral", "deepseek_v3"]


def _modeling_file(model_type: str) -> Path:
    import transformers

    return Path(transformers.__file__).parent / "models" / model_type / f"modeling_{model_type}.py"


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_real_modeling_file(model_type: str) -> None:
    path = _modeling_file(model_type)
    if not path.exists():
        pytest.skip(f"{path.name} not in this transformers version")
    package = f"transformers.models.{model_type}"
    config_module = f"{package}.configuration_{model_type}"
    source = path.read_text()
    code, applied = apply_codemods(source, package, {config_module: "models.configuration_my_model"})

    # Most models' PreTrainedModel keeps transformers' default _init_weights: nothing to declare.
    defines_init = "def _init_weights" in source
    assert applied == [name_of(c) for c in vendoring_commands(package, {}, True)
                       if c is not TransformersInitWeightsCommand or defines_init]
    assert ("def is_custom_code" in code) is defines_init
    tree = ast.parse(code)
    compile(code, str(path), "exec")
    relative = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    assert not relative
    assert "from models.configuration_my_model import" in code
    assert "gradient_checkpointing" not in code
    assert "GradientCheckpointingLayer" not in code
    assert GUARD.strip() in code

    causal_lm = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("ForCausalLM"))
    init_args = _method(causal_lm, "__init__").args
    names = [a.arg for a in init_args.args]
    assert "runner_settings" in names
    assert ast.unparse(init_args.defaults[names.index("runner_settings") - len(names)]) == "None"
    assert init_args.kwarg is not None and init_args.kwarg.arg == "kwargs"

    forward = _method(causal_lm, "forward")
    params = [a.arg for a in forward.args.args + forward.args.kwonlyargs]
    assert "labels" not in params
    body_names = {n.id for stmt in forward.body for n in ast.walk(stmt) if isinstance(n, ast.Name)}
    assert not body_names & {"labels", "loss"}

    assert find_model_class_imports(code) == []


def _prune(code: str, roots: list[str]) -> str:
    command = PruneUnreachableDefinitionsCommand(CodemodContext(), roots=roots)
    return command.transform_module(cst.parse_module(code)).code


def _siblings(model_type: str, name: str) -> dict[str, str]:
    package = f"transformers.models.{model_type}"
    return {
        f"{package}.configuration_{model_type}": f"models.configuration_{name}",
        f"{package}.modeling_{model_type}": f"models.modeling_{name}",
    }


@functools.lru_cache
def _vendored(model_type: str, kind: str, name: str, root: str | None = None) -> str:
    """`{kind}_{model_type}.py` codemodded (configuration files without the torch_npu guard) and,
    given a root, pruned to what it uses. Cached: the pruned gemma3 file serves two tests."""
    source = _modeling_file(model_type).with_name(f"{kind}_{model_type}.py").read_text()
    code, _ = apply_codemods(source, f"transformers.models.{model_type}", _siblings(model_type, name),
                             runs_model=kind != "configuration")
    return _prune(code, [root]) if root else code


def _class_names(code: str) -> set[str]:
    return {n.name for n in ast.parse(code).body if isinstance(n, ast.ClassDef)}


@pytest.mark.parametrize(
    ("model_type", "root", "kept", "removed"),
    [
        ("gemma3", "Gemma3ForCausalLM", ["Gemma3TextModel", "Gemma3DecoderLayer"],
         ["Gemma3ForConditionalGeneration", "Gemma3Model", "Gemma3TextForSequenceClassification"]),
        ("llama", "LlamaForCausalLM", ["LlamaModel", "LlamaPreTrainedModel"],
         ["LlamaForSequenceClassification", "LlamaForQuestionAnswering"]),
    ],
)
def test_prune_real_modeling_file(model_type: str, root: str, kept: list[str], removed: list[str]) -> None:
    path = _modeling_file(model_type)
    if not path.exists():
        pytest.skip(f"{path.name} not in this transformers version")
    pruned = _vendored(model_type, "modeling", "x", root)

    compile(pruned, str(path), "exec")
    assert find_model_class_imports(pruned) == []  # gemma3: `AutoModel` went with the multimodal classes
    classes = _class_names(pruned)
    assert {root, *kept} <= classes
    assert not classes & set(removed)
    exported = next(
        n for n in ast.parse(pruned).body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "__all__"
    )
    assert set(ast.literal_eval(exported.value)) <= classes


# Smoke checks run on a recipe dir; one subprocess runs them all, since importing torch and
# transformers there is most of the time. Each prints "<name>-OK" when it passes.
SMOKES = {
    "llama": """
import torch
from transformers.models.llama.modeling_llama import LlamaForCausalLM as Original
from models.configuration_my_model import LlamaConfig
from models.modeling_my_model import LlamaForCausalLM

config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
torch.manual_seed(0)
vendored = LlamaForCausalLM(config, runner_settings={"device": "cpu"}).eval()
original = Original(config).eval()
original.load_state_dict(vendored.state_dict())
ids = torch.tensor([[1, 2, 3, 4, 5]])
with torch.no_grad():
    assert torch.equal(vendored(ids).logits, original(ids).logits)
    out = vendored.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, original.generate(ids, max_new_tokens=3, do_sample=False))
""",
    "gemma3": """
import os

import torch
from transformers import AutoModelForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping

from models.configuration_x import Gemma3TextConfig
from models.modeling_x import Gemma3ForCausalLM

ckpt = os.environ["GEMMA3_TEXT_CKPT"]
config = Gemma3TextConfig.from_pretrained(ckpt)
for key in (Gemma3ForCausalLM.__name__, config.model_type):  # as the engine does for vendored classes
    mapping = get_checkpoint_conversion_mapping(key)
    if mapping is not None:
        register_checkpoint_conversion_mapping(key, mapping, overwrite=True)
vendored, info = Gemma3ForCausalLM.from_pretrained(ckpt, config=config, output_loading_info=True)
assert not info["missing_keys"] and not info["mismatched_keys"], info
original = AutoModelForCausalLM.from_pretrained(ckpt)
assert type(vendored).__module__ == "models.modeling_x", type(vendored)
assert type(original).__module__.startswith("transformers."), type(original)
ids = torch.tensor([[1, 5, 9, 17, 33, 65, 2]])
with torch.no_grad():
    diff = (vendored.eval()(ids).logits - original.eval()(ids).logits).abs().max().item()
assert diff <= 1e-4, diff
""",
}

RUN_SMOKES = """
import runpy, sys, traceback
for path in sys.argv[1:]:
    name = path.removeprefix("smoke_").removesuffix(".py")
    try:
        runpy.run_path(path, run_name="__main__")
    except BaseException:
        print(f"--- {name} failed ---", file=sys.stderr)
        traceback.print_exc()
    else:
        print(f"{name}-OK")
"""


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess:
    """A recipe dir with codemodded llama files and pruned gemma3 files, and the smoke checks' run."""
    from agent.testing.tiny_checkpoint import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint("gemma3_text", tmp_path_factory.mktemp("gemma3_text"))
    recipe = tmp_path_factory.mktemp("recipe")
    models = recipe / "models"  # namespace package, as in a recipe
    models.mkdir()
    for kind in ("configuration", "modeling"):
        (models / f"{kind}_my_model.py").write_text(_vendored("llama", kind, "my_model"))
    (models / "configuration_x.py").write_text(_vendored("gemma3", "configuration", "x"))
    (models / "modeling_x.py").write_text(_vendored("gemma3", "modeling", "x", "Gemma3ForCausalLM"))
    for name, script in SMOKES.items():
        (recipe / f"smoke_{name}.py").write_text(script)

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(recipe), GEMMA3_TEXT_CKPT=str(ckpt))
    return subprocess.run([sys.executable, "-c", RUN_SMOKES, *(f"smoke_{n}.py" for n in SMOKES)],
                          cwd=recipe, capture_output=True, text=True, env=env, timeout=180)


def test_vendored_llama_matches_transformers(smoke_run: subprocess.CompletedProcess) -> None:
    """The codemodded llama files import from a recipe dir and compute the same logits."""
    assert smoke_run.returncode == 0, smoke_run.stderr[-2000:]
    assert "llama-OK" in smoke_run.stdout, smoke_run.stderr[-3000:]


def test_vendored_pruned_gemma3_text_matches_transformers(smoke_run: subprocess.CompletedProcess) -> None:
    """The pruned gemma3 file (no AutoModel) loads a gemma3_text checkpoint: same logits as transformers."""
    assert smoke_run.returncode == 0, smoke_run.stderr[-2000:]
    assert "gemma3-OK" in smoke_run.stdout, smoke_run.stderr[-3000:]
    # runner_settings is documented, so @auto_docstring prints no "[ERROR] `runner_settings` ..." line.
    assert "runner_settings" not in smoke_run.stdout + smoke_run.stderr
