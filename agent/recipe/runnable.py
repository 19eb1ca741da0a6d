"""Whether a recipe can run on this host before anything runs or is edited: exit 4 with one line when it
calls NPU kernels (agent.recipe.npu_scan) and no NPU is usable, naming compiled custom ops
(agent.recipe.compiled_ops) that not even the npu stand-in can run, else saying that `--standin` can
validate it."""

from __future__ import annotations

import shlex

from agent.errors import EnvironmentProblem, InputError
from agent.recipe import compiled_ops, npu_scan
from agent.recipe.model_type import recipe_model_type
from agent.recipe.recipe import Recipe


def ensure_runnable_here(recipe: Recipe) -> None:
    """Exit 4 before any run or edit when the recipe calls NPU kernels and this host has no NPU."""
    scan = npu_scan.scan_recipe(recipe.path, recipe.repo_root, list(recipe.entry_files))
    if scan.needs_npu and not npu_scan.npu_usable():
        hint = ""
        if recipe.target.standin_runnable:
            certain, _ = compiled_ops.scan(recipe)
            if certain:
                raise EnvironmentProblem(compiled_ops.message(certain))
            hint = (f"; off an NPU, `migrator run {recipe.path} --standin{' --tiny' if _tiny_possible(recipe) else ''}` "
                    "can validate it (the npu stand-in, torch_npu kernels as reference implementations"
                    f"{'' if _tiny_possible(recipe) else '; with local weights: no config class of it names an architecture for --tiny'})")
        elif recipe.target.runs_own_infer_sh:      # its own infer.sh, from any working directory
            hint = (f"; off an NPU, `migrator standin -- bash {shlex.quote(str(recipe.path / 'infer.sh'))}` runs it "
                    "under the npu stand-in (torch_npu kernels as reference implementations)")
        raise EnvironmentProblem(scan.message() + hint)


def _tiny_possible(recipe: Recipe) -> bool:
    """Whether `--tiny` can build a checkpoint for the recipe: a config class of it names a model_type."""
    try:
        return bool(recipe_model_type(recipe, recipe.settings()))
    except (InputError, OSError, SyntaxError, ValueError):
        return False
