"""The training-only `labels` argument and loss computation removed from forward methods."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext

from agent.codemods._toolkit import drop_small_statements, Command, NameCounter, ScopeMixin, StaticBranchMixin, param_names, remove_from_sequence, remove_param


_LOSS_NONE_ASSIGN = m.Assign(targets=[m.AssignTarget(target=m.Name("loss"))], value=m.Name("None"))


def _is_none_check(expr: cst.BaseExpression, name: str) -> bool | None:
    """`name is not None` -> False and `name is None` / `name` -> as if `name` were None."""
    if m.matches(expr, m.Name(name)):
        return False
    if m.matches(expr, m.Comparison(left=m.Name(name), comparisons=[m.ComparisonTarget(comparator=m.Name("None"))])):
        operator = expr.comparisons[0].operator
        if isinstance(operator, cst.IsNot):
            return False
        if isinstance(operator, cst.Is):
            return True
    return None


class RemoveLabelsLossCommand(StaticBranchMixin, ScopeMixin, Command):
    DESCRIPTION = "Remove the training-only `labels` argument and loss computation from forward methods."

    def __init__(self, context: CodemodContext):
        super().__init__(context)
        self._init_scopes()
        self._init_branches()
        self._active: list[bool] = []  # one entry per enclosing FunctionDef

    def _pruning_active(self) -> bool:
        return any(self._active)

    def _leaf_truth(self, expr: cst.BaseExpression) -> bool | None:
        # Without labels no loss is computed: both are None from here on.
        value = _is_none_check(expr, "labels")
        return _is_none_check(expr, "loss") if value is None else value

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        in_module_class = self._scopes == ["class"]
        self._active.append(
            in_module_class and node.name.value == "forward" and "labels" in param_names(node.params)
        )
        super().visit_FunctionDef(node)
        return self._pruning_active()  # nothing to do in other functions

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.FunctionDef:
        self._scopes.pop()
        if self._active.pop():
            updated_node = updated_node.with_changes(params=remove_param(updated_node.params, "labels"))
            leftover = NameCounter("labels")
            updated_node.body.visit(leftover)
            if leftover.uses:
                # A use of `labels` this codemod does not understand; the code would fail on it.
                self.warn(f"{original_node.name.value}: `labels` still used after removing the parameter")
        return updated_node

    def leave_SimpleStatementLine(self, original_node, updated_node):
        if not self._pruning_active():
            return updated_node
        return drop_small_statements(updated_node, lambda s: m.matches(s, _LOSS_NONE_ASSIGN))

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if not self._pruning_active():
            return updated_node
        # `Output(loss=loss, ...)` and a pass-through `labels=labels` would reference removed names.
        drop = m.Arg(keyword=m.Name("loss"), value=m.Name("loss")) | m.Arg(
            keyword=m.Name("labels"), value=m.Name("labels")
        )
        args = remove_from_sequence(updated_node.args, lambda a: not m.matches(a, drop))
        # `self.pred_layer(hidden_states, labels)` / `head(x, target=labels)`: the callee gets what
        # `labels` always was at inference, None (XLM's XLMPredLayer.forward(x, y=None)).
        passed = m.Arg(value=m.Name("labels"), star="")
        args = [a.with_changes(value=cst.Name("None")) if m.matches(a, passed) else a for a in args]
        if args == list(updated_node.args):
            return updated_node
        return updated_node.with_changes(args=args)
