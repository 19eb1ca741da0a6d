"""Which Hugging Face architecture a recipe is: the `model_type` of its own configuration class, read
with `ast` (nothing imported or run) — for a framework model the class the checkout's registry
(executor/core/support_models.py) names for the YAML's model_name; for a legacy recipe the class its
runner passes to `init_model(XForCausalLM, XConfig)` (a recipe may hold other configs too: kimi_k3's
draft model `configuration_dspark.py` says "qwen3"); else a configuration_*.py of the recipe."""

from __future__ import annotations

import ast
from pathlib import Path

from agent.errors import InputError
from agent.recipe.recipe import Recipe, runner_files
from agent.recipe.targets import REGISTRY


def recipe_model_type(recipe: Recipe, settings: dict) -> str:
    """The HF model_type of the recipe's own config class, read from the sources its target names
    (Target.model_type_sources, in order: SOURCES)."""
    name = recipe.target.schema.get(settings, "model_name") if "registry" in recipe.target.model_type_sources else None
    candidates: list[tuple[Path, str | None]] = []
    for source in recipe.target.model_type_sources:
        candidates += SOURCES[source](recipe, name)
    for path, cls in candidates:
        found = _class_model_type(path, cls) if path.is_file() else None
        if found:
            return found
    named = f" for the YAML's model_name {name!r}" if name else " in the recipe's files"
    raise InputError(f"{recipe.path}: no config class with a model_type{named}; --tiny cannot tell which "
                     "architecture to build (point the YAML's model_path at local weights)")


def _registry_config_classes(recipe: Recipe, name: str | None) -> list[tuple[Path, str]]:
    """The config class the checkout's registry names for the YAML's model_name (a framework model)."""
    if not name or recipe.repo_root is None or not (recipe.repo_root / REGISTRY).is_file():
        return []
    return [(recipe.repo_root.joinpath(*module.split(".")).with_suffix(".py"), attr)
            for module, attr in _registry(recipe.repo_root / REGISTRY).get(name, []) if attr.endswith("Config")]


def _configuration_files(recipe: Recipe, name: str | None) -> list[tuple[Path, None]]:
    return [(p, None) for p in sorted(recipe.path.rglob("configuration_*.py"))]


def _runner_config_classes(recipe_dir: Path) -> list[tuple[Path, str]]:
    """(file, class) of the config classes a legacy recipe's runner_*.py / infer.py passes to
    `init_model(MODEL, CONFIG)` (upstream's ModelRunner.init_model), resolved through the file's
    `from models.X import Y [as Z]` imports; the main model's call (…ForCausalLM) first."""
    found: list[tuple[int, Path, str]] = []
    for source in runner_files(recipe_dir) + [recipe_dir / "infer.py"]:
        try:
            tree = ast.parse(source.read_text(encoding="utf-8", errors="replace"))
        except (OSError, SyntaxError, ValueError):
            continue
        imported = {alias.asname or alias.name: (node.module, alias.name) for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "init_model"
                    and len(node.args) >= 2 and all(isinstance(a, ast.Name) for a in node.args[:2])):
                continue
            model, config = (imported.get(a.id, (None, a.id)) for a in node.args[:2])
            if config[0] is None or not config[1].endswith("Config"):
                continue
            path = recipe_dir.joinpath(*config[0].split(".")).with_suffix(".py")
            found.append((0 if model[1].endswith("ForCausalLM") else 1, path, config[1]))
    return [(path, cls) for _, path, cls in sorted(found, key=lambda item: item[0])]


def _registry(path: Path) -> dict[str, list[tuple[str, str]]]:
    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    for node in ast.walk(tree):
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Dict):
            try:
                data = ast.literal_eval(value)
            except ValueError:
                continue
            if isinstance(data, dict) and all(isinstance(v, list) for v in data.values()):
                return data
    return {}


def _class_model_type(path: Path, cls: str | None) -> str | None:
    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and (cls is None or node.name == cls):
            for stmt in node.body:
                if (isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "model_type"
                                                         for t in stmt.targets)
                        and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)):
                    return stmt.value.value
    return None


# where a model_type is read: a target's model_type_sources name these, in its order
SOURCES = {
    "registry": _registry_config_classes,
    "runner_init": lambda recipe, name: _runner_config_classes(recipe.path),
    "configuration_files": _configuration_files,
}
