"""A tokenizer loaded with from_pretrained falls back to EOS as its pad token."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext

from agent.codemods._toolkit import Command, dotted


def _tokenizer_load(stmt: cst.BaseStatement) -> cst.BaseAssignTargetExpression | None:
    """`<target> = <...Tokenizer...>.from_pretrained(...)` -> target."""
    if not m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget()], value=m.Call(
            func=m.Attribute(attr=m.Name("from_pretrained"))))])):
        return None
    assign = stmt.body[0]
    try:
        owner = dotted(assign.value.func.value)
    except ValueError:      # a call or subscript: not a tokenizer class
        return None
    return assign.targets[0].target if "Tokenizer" in owner else None


def _pad_fallback_of(stmt: cst.BaseStatement, target_code: str) -> bool:
    return isinstance(stmt, cst.If) and f"{target_code}.pad_token" in cst.Module(body=[stmt]).code


class PadTokenFallbackCommand(Command):
    DESCRIPTION = "After a tokenizer is loaded with from_pretrained, fall back to EOS as its pad token."

    def __init__(self, context: CodemodContext):
        super().__init__(context)
        self._module: cst.Module | None = None

    def visit_Module(self, node: cst.Module) -> None:
        self._module = node

    def _patch(self, body: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        out: list[cst.BaseStatement] = []
        for i, stmt in enumerate(body):
            out.append(stmt)
            target = _tokenizer_load(stmt)
            if target is None:
                continue
            name = cst.Module(body=[]).code_for_node(target)
            if i + 1 < len(body) and _pad_fallback_of(body[i + 1], name):
                continue
            module = self._module
            out.append(cst.parse_statement(
                f"if {name}.pad_token is None:  # batches need padding: pad with EOS (masked out){module.default_newline}"
                f"{module.default_indent}{name}.pad_token = {name}.eos_token{module.default_newline}",
                config=module.config_for_parsing))
        return out

    def leave_IndentedBlock(self, original_node, updated_node):
        body = self._patch(list(updated_node.body))
        return updated_node.with_changes(body=body) if len(body) != len(updated_node.body) else updated_node

    def leave_Module(self, original_node, updated_node):
        body = self._patch(list(updated_node.body))
        return updated_node.with_changes(body=body) if len(body) != len(updated_node.body) else updated_node
