"""Targets as data (agent/recipe/targets.py): what differs by target is a column of its row, so no code
outside targets.py compares anything with a target's name, tests membership in a set of them, keys a
dict by them or looks a row up by a literal name. Walks every module of the product with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path


from agent.recipe.targets import NOT_A_RECIPE, TARGETS
from locations import REPO_ROOT

ROOT = REPO_ROOT
PACKAGES = ("agent", "engine", "npu_standin", "scripts")
OWNER = ROOT / "agent" / "recipe" / "targets.py"
NAMES = frozenset(TARGETS) | {NOT_A_RECIPE.name}


def _names_in(node: ast.AST) -> set[str]:
    """The target names among the string constants directly in `node` (a tuple/list/set of them too)."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {item.value for item in items if isinstance(item, ast.Constant) and item.value in NAMES}


def target_name_branches(path: Path, root: Path = ROOT) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Compare):
            hits = set().union(*(_names_in(n) for n in (node.left, *node.comparators)))
        elif isinstance(node, ast.Dict):
            hits = set().union(*(_names_in(k) for k in node.keys if k is not None))
        elif isinstance(node, ast.Subscript):
            hits = _names_in(node.slice)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get" and node.args:
            hits = _names_in(node.args[0]) | set().union(*(_names_in(a) for a in node.args[1:]))
        else:
            continue
        found += [f"{path.relative_to(root)}:{node.lineno}: {name!r}" for name in sorted(hits)]
    return found


def test_no_code_outside_targets_py_branches_on_a_target_name():
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py")) if p != OWNER]
    assert len(files) > 50
    found = [hit for path in files for hit in target_name_branches(path)]
    assert found == []


def test_the_walk_finds_each_form_of_branch(tmp_path):
    """The checker itself: each form a branch on a name takes is reported (so the test above can fail)."""
    probe = tmp_path / "probe.py"
    probe.write_text('if kind == "framework": pass\n'
                     'if kind in ("standalone", "legacy"): pass\n'
                     'x = {"legacy": 1}\n'
                     'row = TARGETS["standalone"]\n'
                     'row = TARGETS.get(kind, TARGETS["standalone"])\n'
                     'ok = kind == "checkpoint"\n')
    found = target_name_branches(probe, tmp_path)
    assert [line.split(":", 1)[1] for line in found] == [
        "1: 'framework'", "2: 'legacy'", "2: 'standalone'", "3: 'legacy'", "4: 'standalone'",
        "5: 'standalone'"]
