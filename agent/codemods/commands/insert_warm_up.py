"""A warm-up generation inserted before the first formal one."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext

from agent.codemods._toolkit import Command


def generate_calls(node: cst.CSTNode) -> list[cst.Call]:
    return m.findall(node, m.Call(func=m.Attribute(attr=m.Name("model_generate"))))


def warm_up_argument(call: cst.Call) -> bool | None:
    """True/False for warm_up=<literal>, None when the call has no warm_up argument."""
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == "warm_up":
            return not (isinstance(arg.value, cst.Name) and arg.value.value in ("False", "None"))
    return None if len(call.args) < 2 else True   # model_generate(prompts, True)


class InsertWarmUpCommand(Command):
    DESCRIPTION = "Insert `<runner>.model_generate(prompts, warm_up=True)` before the first formal generation."

    def __init__(self, context: CodemodContext):
        super().__init__(context)
        self._module: cst.Module | None = None
        self._done = False

    def visit_Module(self, node: cst.Module) -> None:
        self._module = node
        self._done = any(warm_up_argument(c) for c in generate_calls(node))   # a warm-up is there already

    def leave_SimpleStatementLine(self, original_node, updated_node):
        if self._done:
            return updated_node
        formal = next((c for c in generate_calls(updated_node) if c.args and warm_up_argument(c) is None), None)
        if formal is None:
            return updated_node
        module = self._module
        inserted = f"{module.code_for_node(formal.func)}({module.code_for_node(formal.args[0].value)}, warm_up=True)"
        self._done = True
        self.context.scratch["inserted"] = inserted
        warm = cst.parse_statement(inserted + module.default_newline, config=module.config_for_parsing)
        # The warm-up takes the formal call's leading comments/blank lines: directly before it.
        return cst.FlattenSentinel([warm.with_changes(leading_lines=updated_node.leading_lines),
                                    updated_node.with_changes(leading_lines=())])
