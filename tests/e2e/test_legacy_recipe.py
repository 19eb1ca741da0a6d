"""Recipes rendered by the release before the engine owned the loop (tag pre-redesign) still run.

tests/data/legacy_recipe/ holds such a recipe's runner and infer.py: the runner passes its classes
to `init_model`, prepares inputs and processes outputs itself over an `input_dict`, and calls
`super().model_generate(input_dict, input_lens, warm_up)`. Swapped into a recipe the current
release migrated from the same tiny checkpoint, `bash infer.sh` must produce the greedy tokens of
transformers and of the current runner.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import json
import textwrap

import pytest
import yaml

from locations import REPO_ROOT
from migrator_cli import run_cli
from locations import DATA

LEGACY = DATA / "legacy_recipe"


@pytest.fixture(scope="module")
def current_recipe(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny llama migrated by this release, batch of 2 prompts (left padding)."""
    out = tmp_path_factory.mktemp("legacy")
    proc = run_cli("run", str(tiny_checkpoints("llama")), "--name", "legacy", "--output-dir", str(out),
                   "--device", "cpu", "--max-new-tokens", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    recipe = out / "legacy"
    yaml_file = next((recipe / "config").glob("*.yaml"))
    settings = yaml.safe_load(yaml_file.read_text())
    settings["data_config"]["batch_size"] = 2
    yaml_file.write_text(yaml.safe_dump(settings, sort_keys=False))
    return recipe


def _formal_run(recipe: Path, tmp_path: Path) -> dict:
    """`bash infer.sh` for real; the formal run's prompt and greedy tokens (its parity dump)."""
    import torch

    dump = tmp_path / "dump.pt"
    env = {**os.environ, "PYTHON": sys.executable, "RES_PATH": str(tmp_path / "res"),
           "MIGRATOR_PARITY_DUMP": str(dump), "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(["bash", "infer.sh"], cwd=recipe, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    log = (tmp_path / "res" / "log_0.log").read_text()
    assert "legacy inference time cost of prefill is" in log and "legacy inference time cost of decode is" in log
    assert log.count("Request 1: outputs: ") == 2 and "warm-up run ends" in log
    return torch.load(dump)


def _legacy_copy(current_recipe: Path, dest: Path) -> Path:
    """The current recipe with the pre-redesign runner and infer.py swapped in."""
    shutil.copytree(current_recipe, dest, ignore=shutil.ignore_patterns(".migrator", "res", "baseline"))
    for name in ("runner_legacy.py", "infer.py"):
        shutil.copy(LEGACY / name, dest / name)
    assert "super().model_generate(input_dict, input_lens, warm_up)" in (dest / "runner_legacy.py").read_text()
    return dest


def _transformers_tokens(recipe: Path, dump: dict) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    settings = yaml.safe_load(next((recipe / "config").glob("*.yaml")).read_text())
    path = settings["model_path"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    gen = GenerationConfig(do_sample=False, max_new_tokens=settings["data_config"]["max_new_tokens"],
                           eos_token_id=model.generation_config.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.inference_mode():
        out = model.generate(input_ids=dump["input_ids"], attention_mask=dump["attention_mask"], generation_config=gen)
    return out[:, dump["input_ids"].shape[1]:].tolist()


@pytest.mark.slow  # the legacy target's own run-through is in tests/e2e/test_framework_target.py
def test_legacy_runner_matches_transformers_and_the_current_runner(current_recipe, tmp_path):
    current = _formal_run(current_recipe, tmp_path / "current")
    legacy = _legacy_copy(current_recipe, tmp_path / "legacy")
    old = _formal_run(legacy, tmp_path / "old")
    assert old["input_ids"].shape[0] == 2
    expected = _transformers_tokens(legacy, old)
    assert old["generate_ids"].tolist() == expected
    assert current["generate_ids"].tolist() == expected
    assert (old["logits"] - current["logits"]).abs().max().item() == 0


# In the recipe dir: the runner on two prompts of different lengths (left padding), warm-up then
# formal, eager and graph. Graph mode compiles with a backend that runs the traced graph as is
# (tests/e2e/test_graph_mode.py): the legacy runner's own new_cache call gets the StaticCache.
PROBE = textwrap.dedent("""
    import functools, json, sys, torch
    from pathlib import Path
    torch.compile = functools.partial(torch.compile, backend=lambda gm, inputs: gm.forward)
    from engine.config import load_runner_settings
    from models.model_setting import check_vars, update_vars
    from runner_legacy import LegacyRunner
    result = {}
    for mode in ("eager", "graph"):
        settings = load_runner_settings(next(Path("config").glob("*.yaml")))
        settings["exe_mode"], settings["data_config"]["batch_size"] = mode, 2
        check_vars(settings); update_vars(settings)
        runner = LegacyRunner(settings)
        runner.init_model()
        runner.model_generate(sys.argv[1:], warm_up=True)
        texts = runner.model_generate(sys.argv[1:])
        result[mode] = {"ids": runner.last_generate_ids.tolist(), "texts": texts,
                        "static_cache": runner.graph is not None and runner.graph.cache is not None}
    print(json.dumps(result))
""")
PROMPTS = ["An attention function can be described as mapping a query", "Multi-head attention"]


def _probe(recipe: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, *PROMPTS], cwd=recipe, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": f"{recipe}:{REPO_ROOT}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # the legacy runner's parity test covers it by default
def test_legacy_runner_left_padding_and_graph_mode(current_recipe, tmp_path):
    import torch
    from transformers import AutoTokenizer

    current = _probe(current_recipe)
    old = _probe(_legacy_copy(current_recipe, tmp_path / "legacy"))
    assert old["graph"]["static_cache"] and not old["eager"]["static_cache"]
    assert old["eager"]["ids"] == old["graph"]["ids"] == current["eager"]["ids"] == current["graph"]["ids"]
    path = yaml.safe_load(next((current_recipe / "config").glob("*.yaml")).read_text())["model_path"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert bool((inputs["attention_mask"] == 0).any())
    assert old["eager"]["ids"] == _transformers_tokens(current_recipe, dict(inputs))


def test_legacy_runner_imports_the_old_way():
    # The old runner's import line; init_model still takes the classes it passes.
    code = ("import inspect\n"
            "from engine.model_runner import ModelRunner, torch\n"
            "assert list(inspect.signature(ModelRunner.init_model).parameters) == ['self', 'model_cls', 'config_cls']\n"
            "print(torch.__name__)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0 and proc.stdout.strip() == "torch", proc.stderr[-2000:]
