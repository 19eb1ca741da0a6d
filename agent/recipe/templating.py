"""The Jinja environment every template renders in (its filters) and the names a render checks: shared by
agent.recipe.render and the native generator (agent.recipe.native), which agent.recipe.targets consults."""

from __future__ import annotations

import json
import keyword
import re
import shlex

import jinja2
import yaml

from agent.errors import InputError, VendorError
from agent.paths import templates_dir


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
    the comments upstream's YAMLs carry (yaml_comments) after their values."""
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


DENSE_MOE_TP_NOTE = "Dense model has no MoE layer; fixed to 1 to avoid confusion with attn_tp_size"


def yaml_comments(settings: dict) -> dict[tuple[str, str], str]:
    """(section, key) -> the comment upstream's YAMLs put there (a dense model's moe_tp_size of 1 beside
    a split attention)."""
    parallel = settings.get("parallel_config") if isinstance(settings.get("parallel_config"), dict) else {}
    if parallel.get("moe_tp_size") == 1 and isinstance(parallel.get("attn_tp_size"), int) and parallel["attn_tp_size"] > 1:
        return {("parallel_config", "moe_tp_size"): DENSE_MOE_TP_NOTE}
    return {}
