"""Training-only gradient checkpointing removed."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor

from agent.codemods._toolkit import drop_small_statements, Command, DropImportedName, NameCounter, ScopeMixin, StaticBranchMixin, name_of


_SELF_GC = m.Attribute(value=m.Name("self"), attr=m.Name("gradient_checkpointing"))


_SELF_GC_ASSIGN = m.Assign(targets=[m.AssignTarget(target=_SELF_GC)]) | m.AnnAssign(target=_SELF_GC)


_SUPPORTS_GC_ASSIGN = m.Assign(
    targets=[m.AssignTarget(target=m.Name("supports_gradient_checkpointing"))]
) | m.AnnAssign(target=m.Name("supports_gradient_checkpointing"))


_GC_LAYER = "GradientCheckpointingLayer"


class RemoveGradientCheckpointingCommand(StaticBranchMixin, ScopeMixin, Command):
    DESCRIPTION = "Remove training-only gradient checkpointing (flags, branches, GradientCheckpointingLayer)."

    def __init__(self, context: CodemodContext):
        super().__init__(context)
        self._init_scopes()
        self._init_branches()
        self._nn_bound = False

    def _leaf_truth(self, expr: cst.BaseExpression) -> bool | None:
        # At inference `self.gradient_checkpointing` (or a submodule's, e.g.
        # `self.text_model.gradient_checkpointing`) is always False.
        return False if m.matches(expr, m.Attribute(attr=m.Name("gradient_checkpointing"))) else None

    def visit_Module(self, node: cst.Module) -> None:
        binds_nn = m.ImportFrom(module=m.Name("torch"), names=[m.ZeroOrMore(), m.ImportAlias(
            name=m.Name("nn"), asname=None), m.ZeroOrMore()]) | m.Import(names=[m.ZeroOrMore(), m.ImportAlias(
                name=m.Attribute(value=m.Name("torch"), attr=m.Name("nn")),
                asname=m.AsName(name=m.Name("nn"))), m.ZeroOrMore()])
        self._nn_bound = any(
            m.matches(s, m.SimpleStatementLine(body=[m.ZeroOrMore(), binds_nn, m.ZeroOrMore()])) for s in node.body
        )

    def leave_SimpleStatementLine(self, original_node, updated_node):
        in_class = bool(self._scopes) and self._scopes[-1] == "class"
        return drop_small_statements(updated_node, lambda s: m.matches(s, _SELF_GC_ASSIGN) or (
            in_class and m.matches(s, _SUPPORTS_GC_ASSIGN)))

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        self._scopes.pop()
        bases = list(updated_node.bases)
        for i, arg in enumerate(bases):
            if name_of(arg.value) == _GC_LAYER and m.matches(arg.value, m.Name() | m.Attribute()):
                # GradientCheckpointingLayer only wraps forward to checkpoint during training;
                # with gradient_checkpointing False it calls forward unchanged: nn.Module is equivalent.
                if self._nn_bound:
                    module = cst.Attribute(value=cst.Name("nn"), attr=cst.Name("Module"))
                else:
                    module = cst.parse_expression("torch.nn.Module")
                    AddImportsVisitor.add_needed_import(self.context, "torch")
                bases[i] = arg.with_changes(value=module)
        return updated_node.with_changes(bases=bases)

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        counter = NameCounter(_GC_LAYER)
        updated_node.visit(counter)
        if counter.imported and counter.uses == counter.imported:
            updated_node = updated_node.visit(DropImportedName(_GC_LAYER))
        leftover = NameCounter("gradient_checkpointing")
        updated_node.visit(leftover)
        if leftover.uses:
            # e.g. `if self.gradient_checkpointing or x:` is left for a person to simplify.
            self.warn(f"{leftover.uses} reference(s) to gradient_checkpointing left in place")
        return updated_node
