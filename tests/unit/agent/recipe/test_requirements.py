"""A checkout recipe's requirements.txt is the checkout's pinned stack (issue #35.3): what its registered
models pin in models/*/requirements.txt (the most common pin of each package most of them pin),
transformers as vendored, plus what the executor's offline path and the vendored code import.

The default suite checks the rendered file against the snapshot's own files and the rule on a made-up
checkout; `slow`: the rendered file installs into a fresh venv, where the executor's imports, its
InferenceConfig on the recipe's YAML and the registry's load of the recipe's classes succeed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from agent.recipe.requirements import canonical, recipe_requirements
from framework_recipes import legacy, migrated  # noqa: F401 - the module's fixtures
from upstream_checkout import SNAPSHOT

# This machine's torch wheel (/opt/wheels): the checkout pins torch==2.8.0, which is not installable here.
LOCAL_TORCH = "torch==2.13.0"


def _pins(path: Path) -> dict[str, str]:
    return {canonical(re.split(r"[=<>!~ ]", line, 1)[0]): line.strip()
            for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}


def snapshot_stack() -> dict[str, str]:
    """What the snapshot's registered models (the registry's `models.<folder>.` imports) pin, read here
    without the product's code: package -> its most common line, for the packages most of them pin."""
    registry = (SNAPSHOT / "executor" / "core" / "support_models.py").read_text()
    folders = sorted({f for f in re.findall(r'"models\.(\w+)\.', registry)
                      if (SNAPSHOT / "models" / f / "requirements.txt").is_file()})
    # every registered model folder of the snapshot, whatever it gained (pangu_7b is not registered)
    assert {"deepseek_r1", "gpt_oss", "qwen"} <= set(folders) and "pangu_7b" not in folders, folders
    counts: dict[str, Counter] = {}
    for folder in folders:
        for key, line in _pins(SNAPSHOT / "models" / folder / "requirements.txt").items():
            counts.setdefault(key, Counter())[line] += 1
    return {key: c.most_common(1)[0][0] for key, c in counts.items() if sum(c.values()) * 2 > len(folders)}


@pytest.mark.parametrize("fixture", ["migrated", "legacy"])
def test_rendered_requirements_are_the_checkouts_registered_models_pins(fixture, request):
    import transformers

    recipe = request.getfixturevalue(fixture)["recipe"]
    rendered = _pins(recipe / "requirements.txt")
    stack = snapshot_stack()
    assert stack["torch"] == "torch==2.8.0" and stack["datasets"] == "datasets==3.6.0"
    for key, line in stack.items():
        want = f"transformers=={transformers.__version__}" if key == "transformers" else line   # vendored from it
        assert rendered.get(key) == want, (key, rendered.get(key), want)
    assert not any(">=" in line for key, line in rendered.items() if key in ("torch", "transformers"))
    # the executor's own imports beside the stack (read from executor/offline/infer.py's import closure)
    for package in ("pyyaml", "safetensors", "tqdm"):
        assert package in rendered, (package, rendered)
    # datasets 3.6.0 + numpy 1.26.4: the newest pyarrow refuses NumPy 1.x
    assert rendered["pyarrow"] == "pyarrow<26"
    # nothing a minority pins at a version that contradicts the stack (gpt_oss: safetensors==0.4.0)
    assert rendered["safetensors"] == "safetensors" and "tiktoken" not in rendered and "blobfile" not in rendered


def test_the_stack_rule_on_a_made_up_checkout(tmp_path):
    co = tmp_path / "co"
    (co / "executor" / "core").mkdir(parents=True)
    (co / "executor" / "offline").mkdir(parents=True)
    (co / "executor" / "core" / "support_models.py").write_text(
        '_specs = {"a": [("models.a.models.m", "A")], "b": [("models.b.models.m", "B")],'
        ' "c": [("models.c.models.m", "C")]}\n')
    # the offline entry point imports a helper that imports yaml (a relative import, followed)
    (co / "executor" / "offline" / "infer.py").write_text("from executor.offline.helper import x\n")
    (co / "executor" / "offline" / "helper.py").write_text("from .inner import y\n")
    (co / "executor" / "offline" / "inner.py").write_text("import yaml\nimport torch_npu\nimport os\n")
    for name, text in {"a": "torch==2.8.0\nnumpy==1.26.4\neinops==0.8.1\nrare==1.0\n",
                       "b": "torch==2.8.0\nnumpy==2.0.0\neinops==0.8.0\n",
                       "c": "torch == 2.7.0\nnumpy==1.26.4\n",
                       "unregistered": "torch==2.11.0\nnumpy==3.0\n"}.items():
        (co / "models" / name).mkdir(parents=True)
        (co / "models" / name / "requirements.txt").write_text(text)
    vendored = tmp_path / "modeling_x.py"
    vendored.write_text("import torch\nimport sentencepiece\nfrom transformers import PreTrainedModel\n")
    lines = recipe_requirements(co, "5.0.0", [vendored])
    # most common pin, ties to the first folder in name order; a package one of three pins is left out
    assert lines == ["torch==2.8.0", "numpy==1.26.4", "einops==0.8.1", "transformers==5.0.0", "sentencepiece",
                     "pyyaml"], lines


def test_a_checkout_whose_models_pin_nothing_takes_its_agents_md_torch(tmp_path):
    co = tmp_path / "co"
    (co / "executor" / "core").mkdir(parents=True)
    (co / "executor" / "core" / "support_models.py").write_text("_specs = {}\n")
    (co / "AGENTS.md").write_text("CANN 9.0.0 + PyTorch 2.8.0 + torch_npu 2.8.0 + transformers 5.0.0\n")
    assert recipe_requirements(co, "5.0.0") == ["torch==2.8.0", "transformers==5.0.0"]


@pytest.mark.slow
def test_rendered_requirements_install_into_a_fresh_venv_and_run_the_executors_imports(migrated, tmp_path):
    """pip install -r requirements.txt into `python3 -m venv`, its torch line replaced by this machine's CPU
    wheel (torch==2.8.0, the checkout's, has no wheel here); then, under the stand-in, the executor's
    imports, its InferenceConfig on the recipe's YAML, the registry's load of the recipe's classes, and
    the recipe itself through upstream's executor/scripts/infer.sh, all in that venv."""
    from agent.measure import reference as upstream
    from npu_standin.environment import standin_env

    checkout, recipe = migrated["checkout"], migrated["recipe"]
    lines = (recipe / "requirements.txt").read_text().splitlines()
    torch_lines = [line for line in lines if canonical(re.split(r"[=<>!~ ]", line, 1)[0]) == "torch"]
    assert torch_lines == ["torch==2.8.0"], torch_lines
    local = tmp_path / "requirements-cpu.txt"           # the substitution this test makes, and only it
    local.write_text("\n".join(LOCAL_TORCH if line in torch_lines else line for line in lines) + "\n")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-r", str(local)],
                         capture_output=True, text=True, timeout=1500)
    assert pip.returncode == 0, pip.stderr[-3000:]
    env = standin_env("cpu")
    # python3 is the fresh venv's: this interpreter's folder (standin_env puts it on PATH) is taken off
    ours = os.path.dirname(os.path.abspath(sys.executable))
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *(p for p in env["PATH"].split(os.pathsep) if p != ours)])
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(checkout)])
    code = ("import sys, yaml, datasets, transformers, torch\n"
            "from executor.core.config import InferenceConfig\n"   # first, as infer.py does (upstream's import cycle)
            "import executor.offline.infer\n"
            "from executor.core.support_models import load_model_classes\n"
            "c = InferenceConfig.from_dict(yaml.safe_load(open(sys.argv[1])), global_rank=0, local_rank=0)\n"
            "classes = load_model_classes('tiny_llama')\n"
            "print('OK', sys.prefix, datasets.__version__, transformers.__version__, torch.__version__,"
            " c.model_config.model_name, [k.__name__ for k in classes])\n")
    proc = subprocess.run(["python3", "-c", code, str(recipe / "config" / "tiny_llama.yaml")], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.split()
    assert out[:2] == ["OK", str(venv)] and out[2] == "3.6.0" and out[5] == "tiny_llama", proc.stdout
    # the recipe through upstream's launcher, on the venv's python3; its model_path is upstream's placeholder,
    # so the YAML runs as a copy on the checkpoint (the second substitution, the one a migrator run makes)
    settings = yaml.safe_load((recipe / "config" / "tiny_llama.yaml").read_text())
    assert settings["model_config"]["model_path"] == "your_model_path", settings["model_config"]
    settings["model_config"]["model_path"] = str(migrated["checkpoint"])
    (recipe / "config" / "tiny_llama_here.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    run = subprocess.run(upstream.framework_command(checkout, recipe.name, "tiny_llama_here.yaml"), env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    log = upstream.rank_logs(checkout, recipe.name, "tiny_llama_here.yaml")[0].read_text()
    assert "Traceback" not in log and "Request 0: outputs:" in log, log[-3000:]
