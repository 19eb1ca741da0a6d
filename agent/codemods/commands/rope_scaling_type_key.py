"""rope_scaling["type"] read as .get("type", .get("rope_type"))."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext

from agent.codemods._toolkit import Command


class RopeScalingTypeKeyCommand(Command):
    DESCRIPTION = "Read rope_scaling[\"type\"] (renamed rope_type in transformers >= 4.45) as .get(\"type\", .get(\"rope_type\"))."

    def __init__(self, context: CodemodContext):
        super().__init__(context)
        self._targets = 0

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._targets += 1

    def leave_AssignTarget(self, original_node, updated_node):
        self._targets -= 1
        return updated_node

    def leave_Subscript(self, original_node: cst.Subscript, updated_node: cst.Subscript) -> cst.BaseExpression:
        value = updated_node.value
        if self._targets or not m.matches(value, m.Name("rope_scaling") | m.Attribute(attr=m.Name("rope_scaling"))) \
                or not _attribute_chain(value) or len(updated_node.slice) != 1 \
                or not m.matches(updated_node.slice[0], m.SubscriptElement(slice=m.Index(
                    value=m.SimpleString('"type"') | m.SimpleString("'type'")))):
            return updated_node
        quote = updated_node.slice[0].slice.value.value[0]
        get = cst.Attribute(value=value, attr=cst.Name("get"))
        inner = cst.Call(func=get, args=[cst.Arg(cst.SimpleString(f"{quote}rope_type{quote}"))])
        return cst.Call(func=get, args=[
            cst.Arg(cst.SimpleString(f"{quote}type{quote}"), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
            cst.Arg(inner)])


def _attribute_chain(node: cst.BaseExpression) -> bool:
    """a / a.b.c: cheap and side-effect free to evaluate twice."""
    while isinstance(node, cst.Attribute):
        node = node.value
    return isinstance(node, cst.Name)
