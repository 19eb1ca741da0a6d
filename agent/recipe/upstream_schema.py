"""A framework YAML checked against the schema upstream's executor reads, before a run.

cann-recipes-infer's `InferenceConfig.from_dict` (executor/core/config/inference_config.py) reads
four sections (model_config, data_config, parallel_config, scheduler_config; disagg_config) and, in
each, the fields of its dataclass; anything else is ignored without a word. A YAML of the old, flat
schema (`model_path:` at the top, as the legacy recipes' YAMLs are) therefore runs on the defaults
(model_path "" , world_size 1...), and nothing fails where the key is. The fields are read with `ast`
from the checkout's own executor code (nothing imported, no copy of ours), so a newer checkout's
schema is the one checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

import yaml as yamllib
from engine.safe_load import load_yaml

SCHEMA_FILE = Path("executor/core/config/inference_config.py")
ROOT_CLASS = "InferenceConfig"
# one evidence line per key: agent.repair.rules.upstream's yaml_key_of_old_schema matches it
LINE = ("InferenceConfig ignores the top-level key {key!r} of {yaml} (old schema): {schema} reads it as "
        "{section}.{key}")


def schema(repo_root: Path | None) -> dict[str, set[str]] | None:
    """{section: its dataclass's fields} from the checkout's executor; None when it is not there."""
    path = Path(repo_root or "") / SCHEMA_FILE
    if repo_root is None or not path.is_file():
        return None
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except SyntaxError:
        return None
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def fields(node: ast.ClassDef) -> dict[str, str | None]:
        out = {}
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                annotation = stmt.annotation
                name = annotation.id if isinstance(annotation, ast.Name) else \
                    annotation.value if isinstance(annotation, ast.Constant) else None
                out[stmt.target.id] = name
        return out

    root = classes.get(ROOT_CLASS)
    if root is None:
        return None
    return {section: set(fields(classes[cls])) for section, cls in fields(root).items() if cls in classes}


def old_schema_keys(settings: dict, sections: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(key, section) for each top-level key of `settings` that is no section but one section's field."""
    found = []
    for key in settings:
        if key in sections:
            continue
        owners = [section for section, names in sections.items() if key in names]
        if len(owners) == 1:
            found.append((key, owners[0]))
    return found


def check(yaml_path: Path, repo_root: Path | None, shown: str | None = None) -> list[str]:
    """The evidence lines (LINE) for `yaml_path`'s old-schema keys; [] when none or no schema."""
    sections = schema(repo_root)
    if not sections:
        return []
    try:
        settings = load_yaml(Path(yaml_path)) or {}
    except (OSError, UnicodeDecodeError, yamllib.YAMLError):
        return []
    if not isinstance(settings, dict):
        return []
    return [LINE.format(key=key, yaml=shown or Path(yaml_path).name, schema=SCHEMA_FILE.as_posix(), section=section)
            for key, section in old_schema_keys(settings, sections)]
