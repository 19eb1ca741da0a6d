"""Every temporary folder the migrator's own process makes is one the next command can remove: made by
agent.processes.owned_temp (its owner holds an flock inside it for its life), so the one a SIGKILL leaves
behind is removed by remove_orphaned_temp, whatever pid namespace or host its owner ran in
(tests/unit/agent/test_processes.py and tests/e2e/test_command_signals.py run that)."""

from __future__ import annotations

import ast

from locations import REPO_ROOT


# tempfile.TemporaryDirectory / mkdtemp called anywhere but these places, each with why
# ("file::function" -> reason): every other temporary folder is an owned_temp
UNOWNED_TEMP = {
    "agent/processes.py::owned_temp": "owned_temp itself: the folder it then locks",
    "engine/safe_write.py::fill_with": "engine/ carries no process bookkeeping: its callers in agent/ pass "
                                       "owned_temp as the scratch folder (the default is for a standalone recipe)",
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
            up = parents.get(node)
            while up is not None and not isinstance(up, ast.FunctionDef):
                up = parents.get(up)
            found.add(f"{path.relative_to(root).as_posix()}::{up.name if up else '<module>'}")
    assert found == set(UNOWNED_TEMP), sorted(found ^ set(UNOWNED_TEMP))


def test_every_fill_with_of_the_migrator_passes_an_owned_scratch_folder():
    """UserTree.fill_with's default scratch folder is a plain one: the migrator's callers name theirs."""
    missing = []
    for path in sorted(p for d in ("agent", "npu_standin") for p in (REPO_ROOT / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "fill_with":
                scratch = node.args[2] if len(node.args) > 2 else next(
                    (k.value for k in node.keywords if k.arg == "scratch"), None)
                if not (isinstance(scratch, ast.Call) and getattr(scratch.func, "id", "") == "owned_temp"):
                    missing.append(f"{path.relative_to(REPO_ROOT).as_posix()}:{node.lineno}")
    assert missing == []
