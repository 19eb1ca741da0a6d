"""Render a recipe's files from the Jinja templates in templates/.

Every value that reaches a generated file is made safe for that file's language (SPEC §6):
identifiers are validated, Python strings go through `repr`, the YAML is written by a YAML emitter,
shell words are quoted, one-line comments and Markdown are stripped of what could end them. No user
string is ever template source. After rendering, each file is parsed (Python, YAML, `bash -n`).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from agent.child_failure import child_failure
from agent.errors import InputError, VendorError
from agent.recipe.fs_guard import user_tree
from agent.recipe.requirements import recipe_requirements
from agent.recipe.routing import Family
from agent.recipe.targets import OWN_LAYOUT, Target, checkout_root
from agent.recipe.templating import (MAX_NAME_LEN, MODEL_NAME_RE, IDENTIFIER_RE, _shown, environment,  # noqa: F401
                                     is_identifier, normalise_model_name, runner_class_name, yaml_text)
from engine.safe_load import loads_yaml

def template_context(context: dict, family: Family, target: Target = OWN_LAYOUT) -> dict:
    """The render context with derived names, after checking every identifier it carries."""
    name = context["model_name"]
    if not (isinstance(name, str) and MODEL_NAME_RE.match(name) and len(name) <= MAX_NAME_LEN):
        raise InputError(f"recipe name {_shown(name)} is not valid: lower-case ASCII letters, digits and "
                         f"'_', starting with a letter, at most {MAX_NAME_LEN} characters")
    for key in ("model_class", "config_class"):
        if key in context and not is_identifier(context[key]):
            raise VendorError(f"{key} {_shown(context[key])} is not a Python identifier; refusing to render")
    ctx = dict(context, family=family, yaml_name=target.yaml_name(name, int(context.get("world_size") or 1)),
               runner_class=runner_class_name(name))
    # the YAML: the target's schema, in its order; a checkout's YAMLs carry upstream's model_path placeholder
    # (checklist 二.4: the run plan runs a copy with the real path, agent.run.plan)
    ctx["settings"] = target.yaml_settings(dict(ctx, model_path=target.model_path_placeholder or ctx["model_path"]))
    if target.context is not None:
        ctx.update(target.context(ctx))
    return ctx


def render_text(template: str, context: dict, family: Family, target: Target = OWN_LAYOUT) -> str:
    return environment().get_template(template).render(**template_context(context, family, target))


def generated_files(model_name: str, family: Family, target: Target = OWN_LAYOUT,
                    world_size: int = 1, ctx: dict | None = None) -> dict[str, str]:
    """recipe-relative path -> template, for every file the migrator renders (for render context
    `ctx` when given: the target may choose its files by it)."""
    files = {path.format(name=model_name, yaml_name=target.yaml_name(model_name, world_size)): template
             for template, path in target.files(ctx).items()}
    files.update(target.family_files(model_name, family))
    return files


def render_recipe(recipe_dir: Path, context: dict, family: Family, target: Target = OWN_LAYOUT,
                  write_to: Path | None = None) -> list[Path]:
    """Write every generated file; returns the paths written. Deterministic for equal context.
    `write_to`: the folder the files go to when it is not `recipe_dir` itself (a migration's staging
    folder, agent.workflow.store): `recipe_dir` still tells a target its checkout."""
    env = environment()
    out = Path(write_to or recipe_dir)
    # validates before anything is written; the recipe's folder tells a target its checkout
    ctx = template_context(dict(context, recipe_dir=str(recipe_dir)), family, target)
    if target.inside_checkout:      # requirements.txt: the checkout's pinned stack (agent.recipe.requirements)
        ctx["requirements"] = recipe_requirements(checkout_root(recipe_dir), ctx["transformers_version"],
                                                  sorted((out / "models").glob("*.py")))
    files = generated_files(ctx["model_name"], family, target, int(ctx.get("world_size") or 1), ctx)
    texts = {out / rel: env.get_template(template).render(**ctx) for rel, template in files.items()}
    written = []
    recipe_tree = user_tree(out, create=True)
    for path, text in texts.items():
        recipe_tree.write_text(path, text, mode=0o755 if path.suffix == ".sh" else None)
        written.append(path)
    check_parses(written)
    for folder in target.folders:
        recipe_tree.mkdir(out / folder)
    for package in target.carries:
        written += carry_package(package, out)
    return written


def carry_package(package: str, recipe_dir: Path) -> list[Path]:
    """Copy one of this project's packages (its .py files) into the recipe, so that the recipe runs
    where infer-migrator is not installed; infer.sh puts the recipe first on PYTHONPATH."""
    import importlib

    source = Path(importlib.import_module(package).__file__).parent
    copied = []
    for file in sorted(source.rglob("*.py")):
        if "__pycache__" in file.parts:
            continue
        dest = recipe_dir / package / file.relative_to(source)
        user_tree(recipe_dir).write_bytes(dest, file.read_bytes())
        copied.append(dest)
    return copied


def check_parses(paths: list[Path]) -> None:
    """Every generated Python, YAML and shell file parses; otherwise the render is a bug (exit 7)."""
    for path in paths:
        text = path.read_text()
        try:
            if path.suffix == ".py":
                compile(text, str(path), "exec", dont_inherit=True)
            elif path.suffix in (".yaml", ".yml"):
                if not isinstance(loads_yaml(text), dict):
                    raise ValueError("top level is not a mapping")
            elif path.suffix == ".sh":
                proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
                if proc.returncode != 0:
                    raise ValueError(child_failure(proc.stderr, proc.returncode))
        except (SyntaxError, ValueError, yaml.YAMLError) as exc:
            raise VendorError(f"generated {path.name} does not parse ({exc}); this is a bug, please report it") from exc


def render_file(rel: str, context: dict, family: Family, target: Target = OWN_LAYOUT) -> str:
    """The text the templates give for one recipe file (rel: recipe-relative path; any config/ YAML
    is the YAML template's)."""
    files = generated_files(context["model_name"], family, target)
    if rel not in files and rel.startswith("config/") and rel.endswith((".yaml", ".yml")):
        rel = next(path for path in files if path.startswith("config/"))
    return render_text(files[rel], context, family, target)


def write_rendered(recipe_dir: Path, rel: str, context: dict, family: Family) -> Path:
    """Re-render one recipe file in place (a repair: the original is in the round's backup)."""
    path = recipe_dir / rel
    user_tree(recipe_dir).write_text(path, render_file(rel, context, family), mode=0o755 if path.suffix == ".sh" else None)
    return path

