"""An existing recipe's spec (agent.recipe.spec.RecipeSpec), rebuilt for a repair that re-renders a file or
needs a YAML default: from its migration_report.json, its YAML and its checkpoint."""

from __future__ import annotations

import ast
from pathlib import Path

from agent.migrate.vendor import locate_source, read_config
from agent.recipe.recipe import Recipe
from agent.recipe.spec import RecipeSpec


def recipe_spec(recipe: Recipe, model_name: str | None = None, trust_remote_code: bool = False) -> RecipeSpec:
    """An existing recipe's spec, rebuilt from migration_report.json, the YAML and the checkpoint
    (YAML values that validate are kept); the vendored classes from the report, else the
    checkpoint's source, else the runner's imports."""
    report = recipe.report()
    name = model_name or report.get("model_name") or recipe.model_name
    model_dir = recipe.checkpoint_dir()
    config = read_config(model_dir) if model_dir else {}
    vendored = dict(report.get("vendored") or {})
    if not {"model_class", "config_class", "modeling_module", "configuration_module"} <= set(vendored):
        if config:
            try:
                vendored = {**locate_source(config, model_dir, trust_remote_code=trust_remote_code).vendored(),
                            **vendored}
            except Exception:  # noqa: BLE001 - fall back to what the runner imports
                pass
        vendored = {**runner_imports(recipe.path, name), **vendored}
    return RecipeSpec.from_recipe(model_name=name, report=report, settings=recipe.settings(),
                                  model_dir=model_dir, config=config, vendored=vendored)


def runner_imports(recipe_dir: Path, name: str) -> dict:
    """model/config class names from the runner's `from models.X import Cls` lines (read only)."""
    runner = recipe_dir / f"runner_{name}.py"
    found: dict[str, str] = {}
    try:
        tree = ast.parse(runner.read_text())
    except (OSError, SyntaxError, ValueError):
        return found
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.names:
            if node.module == f"models.modeling_{name}":
                found["model_class"] = node.names[0].name
            elif node.module == f"models.configuration_{name}":
                found["config_class"] = node.names[0].name
    return found
