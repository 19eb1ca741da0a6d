"""Module-level definitions the given roots do not use removed."""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext

from agent.codemods._toolkit import Command, DropImportedName, dotted, remove_from_sequence


_DEFINITION = (cst.ClassDef, cst.FunctionDef)


_ALL_TARGET = m.Name("__all__")


_ALL_LINE = m.SimpleStatementLine(body=[
    m.Assign(targets=[m.AssignTarget(target=_ALL_TARGET)]) | m.AugAssign(target=_ALL_TARGET)
    | m.AnnAssign(target=_ALL_TARGET)
])


class _ReadNames(cst.CSTVisitor):
    """Identifiers a node reads: every `Name`, and of `a.b.c` only `a`.

    Attribute names and keyword-argument names are not identifiers of the module, and import
    statements only bind names. Strings (forward references, `_no_split_modules`) are not read.
    """

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def visit_Name(self, node: cst.Name) -> None:
        self.names.add(node.value)

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        node.value.visit(self)
        return False

    def visit_Arg(self, node: cst.Arg) -> bool:
        node.value.visit(self)
        return False

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False


def _read_names(node: cst.CSTNode) -> set[str]:
    visitor = _ReadNames()
    node.visit(visitor)
    return visitor.names


def _all_elements(stmt: cst.SimpleStatementLine) -> list[tuple[cst.BaseSmallStatement, cst.List | cst.Tuple]]:
    return [(s, s.value) for s in stmt.body if isinstance(getattr(s, "value", None), (cst.List, cst.Tuple))]


def _exported(module: cst.Module) -> set[str]:
    """The names listed as string literals in module-level `__all__` statements."""
    names: set[str] = set()
    for stmt in module.body:
        if m.matches(stmt, _ALL_LINE):
            for _, value in _all_elements(stmt):
                for element in value.elements:
                    if isinstance(element.value, cst.SimpleString):
                        names.add(str(element.value.evaluated_value))
    return names


class _DropUnusedImports(DropImportedName):
    """Removes the given bound names from module-level `from x import ...` statements.

    Statements in module-level `if`/`try` blocks count as module level; class and function bodies
    are left alone, and so are `from __future__` and torch_npu imports.
    """

    def __init__(self, names: set[str]):
        super().__init__("")
        self.names = names

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def _drops(self, stmt: cst.ImportFrom, alias: cst.ImportAlias) -> bool:
        module = dotted(stmt.module) if stmt.module is not None else ""
        if not stmt.relative and (module == "__future__" or module.split(".")[0] == "torch_npu"):
            return False
        bound = alias.asname.name if alias.asname is not None else alias.name
        return isinstance(bound, cst.Name) and bound.value in self.names and bound.value != "torch_npu"


class PruneUnreachableDefinitionsCommand(Command):
    """Keeps the module-level classes/functions named in `roots` and whatever they use.

    A definition uses every identifier it reads anywhere inside it (bases, decorators,
    annotations, bodies, defaults); strings such as `_no_split_modules = ["..."]` or quoted
    annotations keep nothing alive. Every other module-level statement is kept and what it reads
    is a root too, except `__all__`, whose pruned names are removed. Names of module-level
    `from x import ...` statements (also inside module-level if/try blocks) that only the pruned
    code read are removed as well; plain `import x`, `from __future__` and torch_npu imports, and
    imports that were unused to begin with, stay. E.g. roots=["Gemma3ForCausalLM"] drops gemma3's
    multimodal classes and with them the `AutoModel` import.
    """

    DESCRIPTION = "Remove module-level classes/functions that the given root definitions do not use."

    def __init__(self, context: CodemodContext, roots: Sequence[str]):
        super().__init__(context)
        self.roots = [roots] if isinstance(roots, str) else list(roots)

    def visit_Module(self, node: cst.Module) -> bool:
        return False  # all the work is on the module's statements, in leave_Module

    def _reachable(self, body: Sequence[cst.BaseStatement]) -> set[str]:
        uses: dict[str, set[str]] = {}
        # Every other module-level statement (`logger = ...`, `if TYPE_CHECKING:`, try/except
        # imports, ...) is kept, so what it reads is a root too. `__all__` is rewritten instead.
        reached = set(self.roots)
        for stmt in body:
            if isinstance(stmt, _DEFINITION):
                uses.setdefault(stmt.name.value, set()).update(_read_names(stmt))
            elif not m.matches(stmt, _ALL_LINE):
                reached |= _read_names(stmt)
        missing = [r for r in self.roots if r not in uses]
        if missing:
            raise ValueError(f"roots {missing} are not module-level classes or functions")
        todo = [name for name in reached if name in uses]
        while todo:
            for name in uses[todo.pop()]:
                if name in uses and name not in reached:
                    reached.add(name)
                    todo.append(name)
        return reached

    @staticmethod
    def _rewrite_all(stmt: cst.SimpleStatementLine, pruned: set[str]) -> cst.SimpleStatementLine:
        body = list(stmt.body)
        for small, value in _all_elements(stmt):
            def keep(e: cst.BaseElement) -> bool:
                return not (isinstance(e.value, cst.SimpleString) and e.value.evaluated_value in pruned)

            elements = remove_from_sequence(value.elements, keep)
            if len(elements) == len(value.elements):
                continue
            if isinstance(value, cst.Tuple) and len(elements) == 1 and not isinstance(elements[0].comma, cst.Comma):
                elements[0] = elements[0].with_changes(comma=cst.Comma())  # ("A",) stays a tuple
            body[body.index(small)] = small.with_changes(value=value.with_changes(elements=elements))
        return stmt.with_changes(body=body)

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        reached = self._reachable(updated_node.body)
        pruned = {s.name.value for s in updated_node.body if isinstance(s, _DEFINITION)} - reached
        if not pruned:
            return updated_node
        body: list[cst.BaseStatement] = []
        for stmt in updated_node.body:
            if isinstance(stmt, _DEFINITION) and stmt.name.value in pruned:
                continue
            body.append(self._rewrite_all(stmt, pruned) if m.matches(stmt, _ALL_LINE) else stmt)
        module = updated_node.with_changes(body=body)
        # Only imports that the pruned code used: one unused from the start stays as it was.
        before = _read_names(updated_node) | _exported(updated_node)
        unused = before - _read_names(module) - _exported(module)
        if unused:
            module = module.visit(_DropUnusedImports(unused))
        return module
