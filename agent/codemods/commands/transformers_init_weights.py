"""Vendored classes with transformers' `_init_weights` declared not custom code."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from agent.codemods._toolkit import Command


_IMPORTS_TRANSFORMERS_INIT = m.SimpleStatementLine(body=[m.ZeroOrMore(), m.ImportFrom(
    module=m.Name("transformers"), names=[m.ZeroOrMore(), m.ImportAlias(name=m.Name("initialization")),
                                          m.ZeroOrMore()]), m.ZeroOrMore()])


_INIT_WEIGHTS = m.FunctionDef(name=m.Name("_init_weights"))


_IS_CUSTOM_CODE = m.FunctionDef(name=m.Name("is_custom_code"))


_NOT_CUSTOM_CODE = cst.parse_statement(
    "@classmethod\n"
    "def is_custom_code(cls) -> bool:\n"
    "    # Vendored transformers code: the loader skips custom code's `_init_weights` on modules without\n"
    "    # tensors of their own, which leaves buffers such a module fills uninitialized (falcon_h1's mup_vector).\n"
    "    return False\n")


class TransformersInitWeightsCommand(Command):
    """Declares the vendored model classes transformers code (`is_custom_code()` False).

    transformers counts any class outside `transformers.*` as custom code, and for custom code its
    loader skips `_init_weights` on every module whose own tensors are all loaded, on the premise
    that remote code writes its weights in place. A module with no tensors of its own is always
    skipped, so what its `_init_weights` does for its children never happens: FalconH1Model fills
    its layers' non-persistent `mup_vector` there, which then stays `torch.empty` (NaN). Vendored
    `_init_weights` uses `transformers.initialization`, whose functions skip loaded tensors, so it
    runs as for transformers' own classes. Applied to classes defining `_init_weights` in modules
    that import `transformers.initialization` (transformers' own files; not remote code that writes
    in place).
    """

    DESCRIPTION = "Mark classes defining _init_weights with transformers.initialization as not custom code."

    def visit_Module(self, node: cst.Module) -> bool:
        return any(m.matches(stmt, _IMPORTS_TRANSFORMERS_INIT) for stmt in node.body)

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False  # module-level classes only; their bodies are read in leave_ClassDef

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        if not isinstance(updated_node.body, cst.IndentedBlock):
            return updated_node
        body = list(updated_node.body.body)
        at = next((i for i, stmt in enumerate(body) if m.matches(stmt, _INIT_WEIGHTS)), None)
        if at is None or any(m.matches(stmt, _IS_CUSTOM_CODE) for stmt in body):
            return updated_node
        body.insert(at + 1, _NOT_CUSTOM_CODE.with_changes(leading_lines=[cst.EmptyLine(indent=False)]))
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))
