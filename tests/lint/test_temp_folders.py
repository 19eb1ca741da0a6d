"""Every temporary folder the migrator's own process makes is one the next command can remove: named by
agent.processes.owned_temp_prefix (its owner's pid and start time), so the one a SIGKILL leaves behind is
removed by remove_orphaned_temp (tests/e2e/test_command_signals.py runs that)."""

from __future__ import annotations

import ast

from locations import REPO_ROOT


# A temporary folder the migrator's own process makes is named by owned_temp_prefix, so the one a SIGKILL leaves
# is removed by the next command; each other one with why ("file::function" -> reason)
UNOWNED_TEMP = {
    "engine/safe_write.py::fill_with": "engine/ carries no process bookkeeping: its callers in agent/ pass "
                                       "owned_temp_prefix (the default is for a standalone recipe's own use)",
}


def test_every_temporary_folder_of_the_migrator_is_one_the_next_command_can_remove():
    root = REPO_ROOT
    found = set()
    for path in sorted(p for d in ("agent", "engine", "npu_standin") for p in (root / d).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("TemporaryDirectory", "mkdtemp")):
                continue
            prefix = next((k.value for k in node.keywords if k.arg == "prefix"), None)
            owned = isinstance(prefix, ast.Call) and getattr(prefix.func, "id", getattr(prefix.func, "attr", "")) \
                == "owned_temp_prefix"
            if not owned:
                up = parents.get(node)
                while up is not None and not isinstance(up, ast.FunctionDef):
                    up = parents.get(up)
                found.add(f"{path.relative_to(root).as_posix()}::{up.name if up else '<module>'}")
    assert found == set(UNOWNED_TEMP), sorted(found ^ set(UNOWNED_TEMP))
