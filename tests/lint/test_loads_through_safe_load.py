"""Every YAML and JSON load goes through engine/safe_load.py (SPEC §6): a walk of the code (and of the templates
a recipe is rendered from) fails on any direct load outside that module; the loader itself needs nothing from
agent/. The loader's own behaviour: tests/unit/engine/test_safe_load.py."""

from __future__ import annotations

import ast
from pathlib import Path

from locations import REPO_ROOT


REPO = REPO_ROOT
CODE = ("agent", "engine", "npu_standin", "scripts")
LOADER = REPO / "engine" / "safe_load.py"
# what reads YAML or JSON text: only engine/safe_load.py may call these
DIRECT = {"json": {"load", "loads", "JSONDecoder"},
          "yaml": {"load", "safe_load", "full_load", "unsafe_load", "load_all", "safe_load_all", "full_load_all",
                   "unsafe_load_all", "compose", "compose_all", "parse", "scan", "SafeLoader", "Loader",
                   "FullLoader", "UnsafeLoader", "CSafeLoader", "CLoader", "BaseLoader", "CBaseLoader"}}


def _direct_loads(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    aliases: dict[str, str] = {}          # local name -> module ("json" / "yaml")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]
                if root in DIRECT:
                    aliases[alias.asname or root] = root
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in DIRECT:
            module = node.module.split(".")[0]
            for alias in node.names:
                if alias.name in DIRECT[module] or alias.name == "*":
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if node.attr in DIRECT[aliases[node.value.id]]:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_direct_yaml_or_json_load_outside_the_loader():
    offenders = []
    for folder in CODE:
        for path in sorted((REPO / folder).rglob("*.py")):
            if path != LOADER and "__pycache__" not in path.parts:
                offenders += _direct_loads(path)
    for path in sorted((REPO / "templates").rglob("*.j2")):    # rendered Python of a recipe
        text = path.read_text(encoding="utf-8")
        offenders += [f"{path.relative_to(REPO)}: {w}" for w in ("json.load", "yaml.safe_load", "yaml.load")
                      if w in text]
    assert not offenders, "direct YAML/JSON loads (use engine.safe_load):\n" + "\n".join(offenders)


def test_the_walk_finds_every_spelling(tmp_path):
    """The grep test can fail: each way of spelling a direct load is found."""
    (tmp_path / "x.py").write_text("import json as j\nimport yaml\nfrom yaml import safe_load\n"
                                   "j.loads('1')\nyaml.load('a', Loader=yaml.SafeLoader)\nyaml.compose('a')\n")
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        found = _direct_loads(tmp_path / "x.py")
    finally:
        REPO = saved
    assert len(found) == 5, found


def test_the_engine_loader_needs_nothing_from_agent():
    """A standalone recipe carries engine/: the loader must import without infer-migrator's agent/."""
    tree = ast.parse(LOADER.read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
              {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in modules if m and m.split(".")[0] in ("agent", "npu_standin")}, modules
