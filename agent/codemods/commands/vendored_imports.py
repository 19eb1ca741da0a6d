"""Absolute imports of transformers modules vendored too pointed at their `models.*` copies."""

from __future__ import annotations

import libcst as cst
from libcst.codemod import CodemodContext

from agent.codemods._toolkit import Command, dotted


class VendoredImportsCommand(Command):
    """Points `from transformers.models.a.b import X` at the vendored copy `models.<stem>`.

    `vendored` maps module names (``transformers.models.llama.configuration_llama``) to the
    recipe module they were copied to (``models.configuration_llama``). Imports anywhere in the
    file are rewritten (also inside functions and `if TYPE_CHECKING:` blocks); the names and
    aliases imported stay as they are.
    """

    DESCRIPTION = "Point absolute imports of transformers modules that are vendored too at their `models.*` copies."

    def __init__(self, context: CodemodContext, vendored: dict[str, str]):
        super().__init__(context)
        self.vendored = dict(vendored)

    def leave_ImportFrom(self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom) -> cst.ImportFrom:
        if updated_node.relative or updated_node.module is None:
            return updated_node
        target = self.vendored.get(dotted(updated_node.module))
        if target is None:
            return updated_node
        return updated_node.with_changes(module=cst.parse_expression(target))
