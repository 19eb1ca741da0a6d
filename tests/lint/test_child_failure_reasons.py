"""A child process's failure is reported by agent.child_failure.child_failure (its exception, not its last
stderr line): no code takes the last line of a child's stderr as a reason (`….stderr….splitlines()[-1]`
or `[-1:]`), in agent/, engine/, npu_standin/ or scripts/."""

from __future__ import annotations

import ast
import re

from locations import REPO_ROOT

ONE_PLACE = "agent/child_failure.py"
_STDERR = re.compile(r"\b(?:stderr|err|err_file)\b")


def _is_last(node: ast.Subscript) -> bool:
    index = node.slice
    minus_one = lambda n: isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub) \
        and isinstance(n.operand, ast.Constant) and n.operand.value == 1            # noqa: E731
    return minus_one(index) or (isinstance(index, ast.Slice) and minus_one(index.lower) and index.upper is None)


def last_stderr_lines(source: str) -> list[int]:
    """Line numbers where the last line of something named like a child's stderr is taken."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and _is_last(node):
            taken = ast.get_source_segment(source, node.value) or ""
            if "splitlines" in taken and _STDERR.search(taken):
                found.append(node.lineno)
    return found


def test_the_check_finds_a_last_stderr_line():
    assert last_stderr_lines("why = (proc.stderr.strip().splitlines() or ['x'])[-1]\n") == [1]
    assert last_stderr_lines("tail = (stderr or stdout).strip().splitlines()[-1:]\n") == [1]
    assert last_stderr_lines("answer = proc.stdout.strip().splitlines()[-1]\n") == []      # a child's answer line


def test_no_child_failure_is_its_last_stderr_line():
    offenders = [f"{path.relative_to(REPO_ROOT).as_posix()}:{line}"
                 for base in ("agent", "engine", "npu_standin", "scripts") for path in sorted((REPO_ROOT / base).rglob("*.py"))
                 if path.relative_to(REPO_ROOT).as_posix() != ONE_PLACE
                 for line in last_stderr_lines(path.read_text(encoding="utf-8"))]
    assert not offenders, f"a child's last stderr line taken as its reason (use agent.child_failure): {offenders}"
