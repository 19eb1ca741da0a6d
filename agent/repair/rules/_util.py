"""Helpers shared by the rule modules: the YAML line editor."""

from __future__ import annotations

from pathlib import Path

import yaml

from agent.recipe.textfile import read_source, write_source


def edit_yaml_line(path: Path, section: str | None, key: str, value, *, root: Path, comment: str | None = None) -> str:
    """Set `section.key: value` in the YAML at `path`, keeping its comments and order (a line edit,
    not a dump). Returns a one-line note. Adds the key at the end of the section (or file) when absent.
    `root`: the recipe the YAML is in (the write is anchored there); `comment`: one line written after
    the value (what it was, why it changed).
    """
    original = path.read_bytes()
    lines = read_source(path).splitlines(keepends=True)
    rendered = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...").strip()
    if comment:
        rendered += "  # " + " ".join(comment.split())
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
            write_source(path, "".join(lines), original, root=root)
            return f"set {section + '.' if section else ''}{key}: {rendered} in {path.name}"
    if section is not None and not in_section and not any(ln.startswith(f"{section}:") for ln in lines):
        lines.append(f"{section}:\n")
        insert_at = len(lines)
    while insert_at > 0 and not lines[insert_at - 1].strip():
        insert_at -= 1
    lines.insert(insert_at, f"{indent}{key}: {rendered}\n")
    write_source(path, "".join(lines), original, root=root)
    return f"added {section + '.' if section else ''}{key}: {rendered} to {path.name}"
