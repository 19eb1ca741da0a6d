"""Render a recipe's files from the Jinja templates in templates/."""

from __future__ import annotations

import re
from pathlib import Path

import jinja2

from agent.paths import templates_dir
from agent.routing import Family

# template -> path inside the recipe ({name} and {yaml_name} filled in)
RECIPE_FILES = {
    "infer.py.j2": "infer.py",
    "infer.sh.j2": "infer.sh",
    "config.yaml.j2": "config/{yaml_name}",
    "model_setting.py.j2": "models/model_setting.py",
    "requirements.txt.j2": "requirements.txt",
    "README.md.j2": "README.md",
}

MODEL_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def normalise_model_name(raw: str) -> str:
    """Recipe name: lower case, underscores (e.g. 'Qwen3-0.6B' -> 'qwen3_0_6b')."""
    name = re.sub(r"[^a-z0-9]+", "_", raw.lower()).strip("_")
    if not name:
        raise ValueError(f"cannot derive a recipe name from {raw!r}; pass --name")
    if name[0].isdigit():
        name = f"m_{name}"
    return name


def yaml_name(model_name: str, world_size: int = 1) -> str:
    return f"{model_name}_{world_size}card_eager.yaml"


def runner_class_name(model_name: str) -> str:
    return "".join(part.capitalize() for part in model_name.split("_")) + "Runner"


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,   # a missing value is a bug, never an empty string
        keep_trailing_newline=True,
        autoescape=False,
    )


def render_recipe(recipe_dir: Path, context: dict, family: Family) -> list[Path]:
    """Write every generated file; returns the paths written. Deterministic for equal context."""
    env = _environment()
    name = context["model_name"]
    ctx = dict(context, family=family, yaml_name=yaml_name(name, context.get("world_size", 1)),
               runner_class=runner_class_name(name))
    files = dict(RECIPE_FILES)
    files[family.runner_template] = f"runner_{name}.py"
    written = []
    for template, target in files.items():
        path = recipe_dir / target.format(name=name, yaml_name=ctx["yaml_name"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(env.get_template(template).render(**ctx))
        if path.suffix == ".sh":
            path.chmod(0o755)
        written.append(path)
    return written
