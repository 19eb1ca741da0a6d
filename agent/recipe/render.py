"""Render a recipe's files from the Jinja templates in templates/.

Every value that reaches a generated file is made safe for that file's language (SPEC §6):
identifiers are validated, Python strings go through `repr`, the YAML is written by a YAML emitter,
shell words are quoted, one-line comments and Markdown are stripped of what could end them. No user
string is ever template source. After rendering, each file is parsed (Python, YAML, `bash -n`).
"""

from __future__ import annotations

import json
import keyword
import re
import shlex
import subprocess
from pathlib import Path

import jinja2
import yaml

from agent.errors import InputError, VendorError
from agent.recipe.fs_guard import user_tree
from agent.paths import templates_dir
from agent.recipe.requirements import recipe_requirements
from agent.recipe.routing import Family
from agent.recipe.targets import OWN_LAYOUT, Target, checkout_root
from engine.safe_load import loads_yaml

MODEL_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
MAX_NAME_LEN = 64
IDENTIFIER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def normalise_model_name(raw: str, explicit: bool = False) -> str:
    """Recipe name: lower case, underscores (e.g. 'Qwen3-0.6B' -> 'qwen3_0_6b').

    A name derived from a model id is cut to MAX_NAME_LEN; a name the user gave (--name) that is
    too long or has no ASCII letter/digit is refused (exit 2).
    """
    name = re.sub(r"[^a-z0-9]+", "_", str(raw).lower()).strip("_")
    if not name:
        raise InputError(f"cannot derive a recipe name from {_shown(raw)}: it needs ASCII letters or "
                         "digits; pass --name my_model")
    if name[0].isdigit():
        name = f"m_{name}"
    if len(name) > MAX_NAME_LEN:
        if explicit:
            raise InputError(f"--name is {len(name)} characters long; use at most {MAX_NAME_LEN}")
        name = name[:MAX_NAME_LEN].rstrip("_")
    return name


def _shown(raw) -> str:
    text = repr(str(raw))
    return text if len(text) <= 80 else text[:77] + "...'"


def runner_class_name(model_name: str) -> str:
    return "".join(part.capitalize() for part in model_name.split("_")) + "Runner"


def is_identifier(value) -> bool:
    """A plain ASCII Python identifier that is not a keyword (class, module and key names)."""
    return isinstance(value, str) and bool(IDENTIFIER_RE.match(value)) and not keyword.iskeyword(value)


# ---- escaping filters: one per target language ------------------------------------------
def _identifier(value) -> str:
    if not is_identifier(value):
        raise VendorError(f"refusing to write {value!r} into Python code: not a Python identifier")
    return value


def _one_line(value) -> str:
    """Text for a comment or a Markdown line: what is not printable (newlines, C0/C1 controls,
    line separators, format characters) becomes a space."""
    return " ".join("".join(c if c.isprintable() else " " for c in str(value)).split())


def _docstring(value) -> str:
    """Text inside a triple-quoted docstring: nothing can close it or start an escape."""
    return _one_line(value).replace("\\", "\\\\").replace('"', '\\"')


def _markdown(value) -> str:
    """Inline Markdown text: no code spans, HTML or line breaks of the user's."""
    return _one_line(value).replace("`", "'").replace("<", "&lt;").replace(">", "&gt;")


def _to_yaml(value) -> str:
    return yaml.safe_dump(value, sort_keys=False, allow_unicode=False, default_flow_style=False, width=4096)


def _yaml_scalar(value) -> str:
    """One YAML scalar in upstream's style: True / False, numbers bare, strings double-quoted
    (JSON's escaping is valid YAML)."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    raise VendorError(f"refusing to write {type(value).__name__} {value!r} as a YAML scalar")


def _yaml_sections(settings: dict) -> str:
    """A YAML of top-level scalars and sections of scalars (upstream's schemas: four sections for the
    framework, scalars then sections for a ModelRunner recipe), a blank line before each section;
    the comments upstream's YAMLs carry (agent.recipe.targets.yaml_comments) after their values."""
    from agent.recipe.targets import yaml_comments

    comments = yaml_comments(settings)
    blocks, scalars = [], []
    for key, value in settings.items():
        if not is_identifier(key):
            raise VendorError(f"refusing to write YAML key {key!r}")
        if not isinstance(value, dict):
            scalars.append(f"{key}: {_yaml_scalar(value)}")
            continue
        lines = [f"{key}:"]
        for leaf, leaf_value in value.items():
            if not is_identifier(leaf):
                raise VendorError(f"refusing to write YAML key {leaf!r}")
            note = comments.get((key, leaf))
            lines.append(f"  {leaf}: {_yaml_scalar(leaf_value)}" + (f"    # {_one_line(note)}" if note else ""))
        blocks.append("\n".join(lines))
    return "\n\n".join((["\n".join(scalars)] if scalars else []) + blocks)


def yaml_text(settings: dict) -> str:
    """A YAML of upstream's schemas as upstream writes it (True / False, strings double-quoted)."""
    return _yaml_sections(settings) + "\n"


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,   # a missing value is a bug, never an empty string
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters.update(py=repr, ident=_identifier, sh=shlex.quote, comment=_one_line, doc=_docstring,
                       md=_markdown, to_yaml=_to_yaml, yaml_scalar=_yaml_scalar, yaml_sections=_yaml_sections)
    return env


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
    if target.family_runner:
        files[f"runner_{model_name}.py"] = family.runner_template
    return files


def render_recipe(recipe_dir: Path, context: dict, family: Family, target: Target = OWN_LAYOUT) -> list[Path]:
    """Write every generated file; returns the paths written. Deterministic for equal context."""
    env = environment()
    # validates before anything is written; the recipe's folder tells a target its checkout
    ctx = template_context(dict(context, recipe_dir=str(recipe_dir)), family, target)
    if target.inside_checkout:      # requirements.txt: the checkout's pinned stack (agent.recipe.requirements)
        ctx["requirements"] = recipe_requirements(checkout_root(recipe_dir), ctx["transformers_version"],
                                                  sorted((recipe_dir / "models").glob("*.py")))
    files = generated_files(ctx["model_name"], family, target, int(ctx.get("world_size") or 1), ctx)
    texts = {recipe_dir / rel: env.get_template(template).render(**ctx) for rel, template in files.items()}
    written = []
    recipe_tree = user_tree(recipe_dir, create=True)
    for path, text in texts.items():
        recipe_tree.write_text(path, text, mode=0o755 if path.suffix == ".sh" else None)
        written.append(path)
    check_parses(written)
    for folder in target.folders:
        recipe_tree.mkdir(recipe_dir / folder)
    for package in target.carries:
        written += carry_package(package, recipe_dir)
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
                    raise ValueError(proc.stderr.strip().splitlines()[-1:])
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

