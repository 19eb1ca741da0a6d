"""agent/recipe/runnable.py, the check before anything runs: a recipe that calls NPU kernels on a host with no
usable NPU is exit 4 in one line naming the kernel and its first call, and how to validate it off an NPU (its
target's way: `--standin` for a cann-recipes-infer recipe, `migrator standin -- bash infer.sh` for one that
runs its own infer.sh); a recipe without NPU kernels, or a host with an NPU, passes."""

from __future__ import annotations

import pytest

from agent.errors import EXIT_ENVIRONMENT, EnvironmentProblem
from agent.recipe import npu_scan
from agent.recipe.recipe import Recipe
from agent.recipe.runnable import ensure_runnable_here
from checkout_fixture import write_executor, write_framework_recipe


def standalone(root, runner_code: str) -> Recipe:
    recipe = root / "ours"
    (recipe / "config").mkdir(parents=True)
    (recipe / "infer.sh").write_text('YAML_FILE="${YAML_FILE:-config/ours_1card_eager.yaml}"\npython3 infer.py\n')
    (recipe / "config" / "ours_1card_eager.yaml").write_text("model_name: ours\nworld_size: 1\n")
    (recipe / "runner_ours.py").write_text("import torch\nimport torch_npu\nfrom engine.model_runner import ModelRunner\n"
                                           + runner_code)
    found = Recipe.at(recipe)
    assert found.kind == "standalone"
    return found


@pytest.fixture
def no_npu(monkeypatch):
    monkeypatch.setattr(npu_scan, "npu_usable", lambda: False)


def test_a_recipe_calling_an_npu_kernel_off_an_npu_is_exit_4_naming_the_call_and_the_way_to_validate(tmp_path, no_npu):
    recipe = standalone(tmp_path, "\n\ndef norm(x, w):\n    return torch_npu.npu_rms_norm(x, w)[0]\n")
    with pytest.raises(EnvironmentProblem) as caught:
        ensure_runnable_here(recipe)
    message = str(caught.value)
    assert caught.value.exit_code == EXIT_ENVIRONMENT == 4 and "\n" not in message
    assert "needs an Ascend NPU: 1 torch_npu kernel (npu_rms_norm) at 1 call site; first call: npu_rms_norm at " \
           "runner_ours.py:7; run on an NPU host" in message, message
    assert f"`migrator standin -- bash {recipe.path / 'infer.sh'}` runs it under the npu stand-in" in message


def test_a_framework_recipe_off_an_npu_is_told_to_run_with_standin(tmp_path, no_npu):
    write_executor(tmp_path)
    recipe = Recipe.at(write_framework_recipe(tmp_path, "fw", tmp_path / "ckpt", npu_kernels=True))
    with pytest.raises(EnvironmentProblem) as caught:
        ensure_runnable_here(recipe)
    assert "needs an Ascend NPU" in str(caught.value) and f"`migrator run {recipe.path} --standin" in str(caught.value)


def test_no_kernel_or_a_usable_npu_passes(tmp_path, monkeypatch, no_npu):
    ensure_runnable_here(standalone(tmp_path / "plain", "\n\ndef f(x):\n    return torch.nn.functional.silu(x)\n"))
    kernels = standalone(tmp_path / "kernels", "\n\ndef f(x, w):\n    return torch_npu.npu_rms_norm(x, w)[0]\n")
    monkeypatch.setattr(npu_scan, "npu_usable", lambda: True)
    ensure_runnable_here(kernels)
