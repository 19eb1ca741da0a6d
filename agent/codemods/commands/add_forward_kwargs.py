"""One class's forward() accepts (and ignores) extra keyword arguments."""

from __future__ import annotations

import libcst as cst
from libcst.codemod import CodemodContext

from agent.codemods._toolkit import Command, insert_param, param_names


class AddForwardKwargsCommand(Command):
    DESCRIPTION = "Let one class's forward() accept (and ignore) extra keyword arguments: add **kwargs."

    def __init__(self, context: CodemodContext, class_name: str, method: str = "forward"):
        super().__init__(context)
        self.class_name, self.method = class_name, method
        self._depth = 0

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self._depth += 1
        return self._depth == 1 and node.name.value == self.class_name

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        self._depth -= 1
        return updated_node

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False  # only the method's signature changes

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.FunctionDef:
        if updated_node.name.value != self.method or updated_node.params.star_kwarg is not None:
            return updated_node
        if not param_names(updated_node.params)[:1] == ["self"]:
            return updated_node
        kwargs = cst.Param(name=cst.Name("kwargs"), star="**")
        return updated_node.with_changes(params=insert_param(updated_node.params, "star_kwarg", kwargs))
