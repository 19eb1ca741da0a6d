"""trust_remote_code=True passed to the from_pretrained call on a given line."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext

from agent.codemods._toolkit import Command
from libcst.metadata import PositionProvider


class TrustRemoteCodeCommand(Command):
    DESCRIPTION = "Pass trust_remote_code=True to the from_pretrained(...) call on a given line."

    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, context: CodemodContext, line: int):
        super().__init__(context)
        self.line = line
        self._target: cst.Call | None = None

    def visit_Call(self, node: cst.Call) -> None:
        if not m.matches(node.func, m.Attribute(attr=m.Name("from_pretrained"))):
            return
        pos = self.get_metadata(PositionProvider, node)
        if pos.start.line <= self.line <= pos.end.line:
            self._target = node       # visited outer -> inner: the innermost call wins

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if original_node is not self._target:
            return updated_node
        args = list(updated_node.args)
        for i, arg in enumerate(args):
            if arg.keyword is not None and arg.keyword.value == "trust_remote_code":
                args[i] = arg.with_changes(value=cst.Name("True"))
                return updated_node.with_changes(args=args)
        new = cst.Arg(keyword=cst.Name("trust_remote_code"), value=cst.Name("True"),
                      equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                            whitespace_after=cst.SimpleWhitespace("")))
        if args:
            last = args[-1]
            sep = next((a.comma for a in reversed(args[:-1]) if isinstance(a.comma, cst.Comma)),
                       cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            new = new.with_changes(comma=last.comma)   # a trailing comma / newline stays at the end
            args[-1] = last.with_changes(comma=sep)
        return updated_node.with_changes(args=[*args, new])
