"""Model classes' `__init__(self, config)` also accept `runner_settings=None, **kwargs`."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext

from agent.codemods._toolkit import Command, DOCSTRING_LINE, ScopeMixin, insert_param, is_model_class, param_names


class RunnerSettingsInitCommand(ScopeMixin, Command):
    DESCRIPTION = "Let model classes' __init__(self, config) also accept runner_settings=None and **kwargs."

    def __init__(self, context: CodemodContext):
        super().__init__(context)
        self._init_scopes()

    @staticmethod
    def _patch_init(func: cst.FunctionDef) -> cst.FunctionDef:
        params = func.params
        names = param_names(params)
        if names[:2] != ["self", "config"] or "runner_settings" in names:
            return func
        runner = cst.Param(
            name=cst.Name("runner_settings"),
            default=cst.Name("None"),
            equal=cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
            ),
        )
        # After a `*args` / bare `*` a new parameter can only be keyword-only.
        slot = "kwonly_params" if not isinstance(params.star_arg, cst.MaybeSentinel) else "params"
        params = insert_param(params, slot, runner)
        if params.star_kwarg is None:
            params = insert_param(params, "star_kwarg", cst.Param(name=cst.Name("kwargs"), star="**"))
        return func.with_changes(params=params, body=RunnerSettingsInitCommand._document(func.body))

    @staticmethod
    def _document(body: cst.BaseSuite) -> cst.BaseSuite:
        """Document runner_settings: transformers' @auto_docstring prints an error for every
        undocumented __init__ argument each time the module is imported."""
        if not isinstance(body, cst.IndentedBlock) or (body.body and m.matches(body.body[0], DOCSTRING_LINE)):
            return body
        pad = " " * 8  # a method of a module-level class
        doc = cst.parse_statement(
            f'r"""\n{pad}runner_settings (`dict`, *optional*):\n{pad}    Recipe settings (the YAML) passed '
            f'by the engine\'s ModelRunner.\n{pad}"""\n')
        return body.with_changes(body=[doc, *body.body])

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        super().visit_ClassDef(node)
        return len(self._scopes) == 1

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        super().visit_FunctionDef(node)
        return False  # __init__ signatures are all that change

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        self._scopes.pop()
        # Only module-level model classes: nested helpers and layers (MLP, attention) keep their API.
        if self._scopes or not is_model_class(updated_node):
            return updated_node
        if not isinstance(updated_node.body, cst.IndentedBlock):
            return updated_node
        body = [
            self._patch_init(s) if m.matches(s, m.FunctionDef(name=m.Name("__init__"))) else s
            for s in updated_node.body.body
        ]
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))
