"""Helpers shared by the rule modules."""

from __future__ import annotations

from pathlib import Path

import yaml

from agent.recipe.textfile import read_source, write_source


def recipe_yaml(recipe_dir: Path) -> Path | None:
    yamls = sorted((recipe_dir / "config").glob("*.yaml"))
    return yamls[0] if yamls else None


def load_yaml(recipe_dir: Path) -> dict:
    """The recipe's settings; {} when the YAML is missing, unreadable or not a mapping (the
    rules read it as evidence and must not crash on a broken one)."""
    path = recipe_yaml(recipe_dir)
    try:
        settings = yaml.safe_load(read_source(path)) if path else {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return settings if isinstance(settings, dict) else {}


def edit_yaml_line(recipe_dir: Path, section: str | None, key: str, value) -> str:
    """Set `section.key: value` keeping the file's comments and order (line edit, not a dump).

    Returns a one-line note. Adds the key at the end of the section (or file) when absent.
    """
    path = recipe_yaml(recipe_dir)
    original = path.read_bytes()
    lines = read_source(path).splitlines(keepends=True)
    rendered = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()
    in_section = section is None
    indent = "" if section is None else "  "
    insert_at = len(lines)
    for i, line in enumerate(lines):
        stripped = line.strip()
        if section is not None and not line.startswith((" ", "\t")) and stripped:
            if in_section:                  # left the section without finding the key
                insert_at = i
                break
            in_section = stripped.startswith(f"{section}:")
            continue
        if in_section and stripped.startswith(f"{key}:") and line.startswith(indent) and \
                (section is None) == (not line.startswith((" ", "\t"))):
            lines[i] = f"{indent}{key}: {rendered}\n"
            write_source(path, "".join(lines), original)
            return f"set {section + '.' if section else ''}{key}: {rendered} in {path.name}"
    if section is not None and not in_section and not any(ln.startswith(f"{section}:") for ln in lines):
        lines.append(f"{section}:\n")
        insert_at = len(lines)
    while insert_at > 0 and not lines[insert_at - 1].strip():
        insert_at -= 1
    lines.insert(insert_at, f"{indent}{key}: {rendered}\n")
    write_source(path, "".join(lines), original)
    return f"added {section + '.' if section else ''}{key}: {rendered} to {path.name}"


def report_data(recipe_dir: Path) -> dict:
    """migration_report.json of the recipe, if the migrator made it ({} otherwise)."""
    import json

    path = recipe_dir / "migration_report.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
