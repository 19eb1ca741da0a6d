"""agent/codemods/commands/blank_line_whitespace.py: no whitespace-only lines (upstream's trailing-whitespace
hook)."""

from __future__ import annotations

from libcst.codemod import CodemodTest

from agent.codemods.commands.blank_line_whitespace import BlankLineWhitespaceCommand
from agent.codemods.driver import transform


class TestBlankLineWhitespaceCommand(CodemodTest):
    TRANSFORM = BlankLineWhitespaceCommand

    def test_noop_on_clean_code(self) -> None:
        code = "class A:\n    x = 1\n\n    def f(self):  # a comment\n        return 1\n"
        assert transform(code, [BlankLineWhitespaceCommand]) == code

    def test_indented_blank_lines_and_line_ends_lose_their_whitespace(self) -> None:
        dirty = "class A:\n    x = 1  \n    \n    def f(self):  # a comment   \n        return 1\n"
        clean = "class A:\n    x = 1\n\n    def f(self):  # a comment\n        return 1\n"
        assert transform(dirty, [BlankLineWhitespaceCommand]) == clean
