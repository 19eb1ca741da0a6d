"""What the codemod commands share: a fast command base, parameter-list surgery, static-branch
pruning, scope tracking, name helpers and the device_ops call builder (private to agent.codemods)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import libcst as cst
import libcst.matchers as m
from libcst.codemod import VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor

# Order in which libcst renders the fields of `Parameters`.
PARAM_SLOTS = ("posonly_params", "posonly_ind", "params", "star_arg", "kwonly_params", "star_kwarg")


LIST_SLOTS = {"posonly_params", "params", "kwonly_params"}


class Command(VisitorBasedCodemodCommand):
    """Base of every command here: a VisitorBasedCodemodCommand without matcher decorators.

    No command uses `@m.visit`/`@m.leave` or `@m.call_if_*`, so the per-node decorator bookkeeping
    of MatcherDecoratableTransformer is skipped: it made each pass ~10x slower.
    """

    @contextmanager
    def _handle_metadata_reference(self, module: cst.Module) -> Iterator[cst.Module]:
        # A command without METADATA_DEPENDENCIES skips the deep copy MetadataWrapper makes of the
        # whole tree on every pass (a third of the run time on large files).
        if self.get_inherited_dependencies():
            with super()._handle_metadata_reference(module) as wrapped:
                yield wrapped
        else:
            yield module

    def on_visit(self, node: cst.CSTNode) -> bool:
        return cst.CSTTransformer.on_visit(self, node)

    def on_leave(self, original_node, updated_node):
        return cst.CSTTransformer.on_leave(self, original_node, updated_node)

    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        return cst.CSTTransformer.on_visit_attribute(self, node, attribute)

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        cst.CSTTransformer.on_leave_attribute(self, original_node, attribute)


def flatten_params(params: cst.Parameters) -> list[tuple[str, cst.CSTNode]]:
    items: list[tuple[str, cst.CSTNode]] = []
    for slot in PARAM_SLOTS:
        value = getattr(params, slot)
        if slot in LIST_SLOTS:
            items.extend((slot, node) for node in value)
        elif value is not None and not isinstance(value, cst.MaybeSentinel):
            items.append((slot, value))
    return items


def unflatten_params(params: cst.Parameters, items: list[tuple[str, cst.CSTNode]]) -> cst.Parameters:
    changes: dict[str, object] = {slot: [] for slot in LIST_SLOTS}
    changes.update(posonly_ind=cst.MaybeSentinel.DEFAULT, star_arg=cst.MaybeSentinel.DEFAULT, star_kwarg=None)
    for slot, node in items:
        if slot in LIST_SLOTS:
            changes[slot].append(node)
        else:
            changes[slot] = node
    return params.with_changes(**changes)


def separator(items: Sequence[tuple[str, cst.CSTNode]], index: int) -> cst.Comma:
    """The comma used between elements near `index` (keeps one-line vs. one-per-line style)."""
    for _, node in reversed(items[: index + 1]):
        if isinstance(node.comma, cst.Comma):
            return node.comma
    return cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))


def insert_param(params: cst.Parameters, slot: str, new: cst.Param) -> cst.Parameters:
    items = flatten_params(params)
    order = PARAM_SLOTS.index(slot)
    pos = sum(1 for s, _ in items if PARAM_SLOTS.index(s) <= order)
    if pos == len(items) and items:
        # Appending: the new last element inherits the old last one's trailing comma and the
        # whitespace before ")" so a one-per-line signature stays one-per-line.
        last_slot, last = items[-1]
        sep = separator(items, len(items) - 2) if len(items) > 1 else separator([], 0)
        new = new.with_changes(comma=last.comma)
        if isinstance(last, cst.Param):
            new = new.with_changes(whitespace_after_param=last.whitespace_after_param)
            last = last.with_changes(whitespace_after_param=cst.SimpleWhitespace(""))
        items[-1] = (last_slot, last.with_changes(comma=sep))
    else:
        new = new.with_changes(comma=separator(items, pos - 1) if pos else cst.MaybeSentinel.DEFAULT)
    items.insert(pos, (slot, new))
    return unflatten_params(params, items)


def remove_param(params: cst.Parameters, name: str) -> cst.Parameters:
    items = flatten_params(params)
    index = next(
        i for i, (_, n) in enumerate(items) if isinstance(n, cst.Param) and n.name.value == name
    )
    old_last = items[-1][1]
    items.pop(index)
    # A bare "*" must be followed by a keyword-only parameter.
    if not any(s == "kwonly_params" for s, _ in items):
        items = [(s, n) for s, n in items if not isinstance(n, cst.ParamStar)]
    if items and items[-1][1] is not old_last:
        # The last element went away: its trailing comma / whitespace moves to the new last.
        slot, last = items[-1]
        last = last.with_changes(comma=old_last.comma)
        if isinstance(last, cst.Param) and isinstance(old_last, cst.Param):
            last = last.with_changes(whitespace_after_param=old_last.whitespace_after_param)
        items[-1] = (slot, last)
    return unflatten_params(params, items)


def param_names(params: cst.Parameters) -> list[str]:
    return [n.name.value for _, n in flatten_params(params) if isinstance(n, cst.Param)]


def remove_from_sequence(elements: Sequence[cst.CSTNode], keep: Callable[[cst.CSTNode], bool]) -> list:
    """Drop elements of a comma-separated sequence (call args, import aliases), fixing the last comma."""
    kept = [e for e in elements if keep(e)]
    if kept and not keep(elements[-1]):
        kept[-1] = kept[-1].with_changes(comma=elements[-1].comma)
    return kept


def drop_small_statements(line: cst.SimpleStatementLine, drop: Callable[[cst.BaseSmallStatement], bool]):
    """The line without the statements `drop` selects (`a = 1; b = 2`), the semicolon of the new
    last one removed; REMOVE when none is left, the line itself when nothing was dropped."""
    body = [s for s in line.body if not drop(s)]
    if len(body) == len(line.body):
        return line
    if not body:
        return cst.RemovalSentinel.REMOVE
    body[-1] = body[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
    return line.with_changes(body=body)


def truth(expr: cst.BaseExpression, leaf: Callable[[cst.BaseExpression], bool | None]) -> bool | None:
    """Static truth value of a condition given what `leaf` knows (None when unknown)."""
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Not):
        inner = truth(expr.expression, leaf)
        return None if inner is None else not inner
    if isinstance(expr, cst.BooleanOperation):
        left, right = truth(expr.left, leaf), truth(expr.right, leaf)
        if isinstance(expr.operator, cst.And):
            if left is False or right is False:
                return False
            return True if left and right else None
        if left is True or right is True:
            return True
        return False if left is False and right is False else None
    return leaf(expr)


def as_statements(suite: cst.BaseSuite) -> list[cst.BaseStatement]:
    if isinstance(suite, cst.IndentedBlock):
        return list(suite.body)
    return [cst.SimpleStatementLine(body=list(suite.body))]


class StaticBranchMixin:
    """Prunes `if` chains and conditional expressions whose condition is statically known.

    Subclasses implement `_leaf_truth`. Empty blocks left behind get a `pass`.
    """

    def _leaf_truth(self, expr: cst.BaseExpression) -> bool | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _pruning_active(self) -> bool:
        return True

    def _init_branches(self) -> None:
        self._elifs: set[int] = set()

    def visit_If(self, node: cst.If) -> None:
        if isinstance(node.orelse, cst.If):
            self._elifs.add(id(node.orelse))

    def leave_If(self, original_node: cst.If, updated_node: cst.If):
        # An `elif` is handled together with the `if` that owns it.
        if id(original_node) in self._elifs or not self._pruning_active():
            return updated_node
        branches: list[cst.If] = []
        node: cst.If | cst.Else | None = updated_node
        while isinstance(node, cst.If):
            branches.append(node)
            node = node.orelse
        else_clause = node
        kept: list[cst.If] = []
        changed = False
        for branch in branches:
            value = truth(branch.test, self._leaf_truth)
            if value is None:
                kept.append(branch)
                continue
            changed = True
            if value:  # always taken: it becomes the else, later branches are unreachable
                else_clause = cst.Else(body=branch.body)
                break
        if not changed:
            return updated_node
        if not kept:
            if else_clause is None:
                return cst.RemovalSentinel.REMOVE
            body = as_statements(else_clause.body)
            body[0] = body[0].with_changes(
                leading_lines=[*updated_node.leading_lines, *body[0].leading_lines]
            )
            return cst.FlattenSentinel(body)
        orelse = else_clause
        for branch in reversed(kept[1:]):
            orelse = branch.with_changes(orelse=orelse)
        return kept[0].with_changes(orelse=orelse, leading_lines=updated_node.leading_lines)

    def leave_IfExp(self, original_node: cst.IfExp, updated_node: cst.IfExp) -> cst.BaseExpression:
        if not self._pruning_active():
            return updated_node
        value = truth(updated_node.test, self._leaf_truth)
        if value is None:
            return updated_node
        result = updated_node.body if value else updated_node.orelse
        # Keep the parentheses that wrapped the whole conditional expression.
        return result.with_changes(
            lpar=[*updated_node.lpar, *result.lpar], rpar=[*result.rpar, *updated_node.rpar]
        )

    def leave_IndentedBlock(
        self, original_node: cst.IndentedBlock, updated_node: cst.IndentedBlock
    ) -> cst.IndentedBlock:
        if original_node.body and not updated_node.body:
            return updated_node.with_changes(body=[cst.SimpleStatementLine(body=[cst.Pass()])])
        return updated_node


class ScopeMixin:
    """Tracks whether the visitor is directly in a module, class or function body."""

    def _init_scopes(self) -> None:
        self._scopes: list[str] = []

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._scopes.append("class")

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        self._scopes.pop()
        return updated_node

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._scopes.append("function")

    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
        self._scopes.pop()
        return updated_node


def name_of(expr: cst.BaseExpression) -> str | None:
    """Last component of `a.b.C` / `C`."""
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        return expr.attr.value
    return None


def ends_with(node: cst.BaseExpression, name: str) -> bool:
    """`forward_metadata`, `self.forward_metadata`, `kwargs.forward_metadata`, ... (a dotted name)."""
    try:
        return dotted(node).split(".")[-1] == name
    except ValueError:   # a call or subscript: not a plain dotted name
        return False


def dotted(expr: cst.BaseExpression | None) -> str:
    if expr is None:
        return ""
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        return f"{dotted(expr.value)}.{expr.attr.value}"
    raise ValueError(f"not a dotted name: {expr!r}")


MODEL_CLASS_SUFFIXES = ("PreTrainedModel", "Model", "ForCausalLM")


def is_model_class(node: cst.ClassDef) -> bool:
    if node.name.value.endswith(MODEL_CLASS_SUFFIXES):
        return True
    return any((name_of(arg.value) or "").endswith(("PreTrainedModel", "Model")) for arg in node.bases)


class NameCounter(cst.CSTVisitor):
    """Counts the `Name` nodes spelling `name`, and how many of them are `from x import name`."""

    def __init__(self, name: str):
        super().__init__()
        self.name, self.uses, self.imported = name, 0, 0

    def visit_Name(self, node: cst.Name) -> None:
        self.uses += node.value == self.name

    def visit_ImportAlias(self, node: cst.ImportAlias) -> None:
        self.imported += isinstance(node.name, cst.Name) and node.name.value == self.name


class DropImportedName(cst.CSTTransformer):
    """Removes `name` from `from x import ...` statements (the whole line when nothing is left)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self._emptied: set[int] = set()
        self._keep_alive: list[cst.CSTNode] = []  # so the ids in _emptied stay unique

    def _drops(self, stmt: cst.ImportFrom, alias: cst.ImportAlias) -> bool:
        return isinstance(alias.name, cst.Name) and alias.name.value == self.name

    def leave_SimpleStatementLine(self, original_node, updated_node):
        body = []
        for stmt in updated_node.body:
            if isinstance(stmt, cst.ImportFrom) and not isinstance(stmt.names, cst.ImportStar):
                names = remove_from_sequence(stmt.names, lambda a, stmt=stmt: not self._drops(stmt, a))
                if not names:
                    continue
                if len(names) != len(stmt.names):
                    stmt = stmt.with_changes(names=names)
            body.append(stmt)
        if not body:
            # Dropped by the enclosing block, which hands its blank lines/comments to the next line.
            placeholder = updated_node.with_changes(body=[cst.Pass()])
            self._emptied.add(id(placeholder))
            self._keep_alive.append(placeholder)
            return placeholder
        if len(body) != len(updated_node.body):
            body[-1] = body[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
        return updated_node.with_changes(body=body)

    def _drop_empty(self, body: Sequence[cst.BaseStatement]) -> list[cst.BaseStatement]:
        out: list[cst.BaseStatement] = []
        pending: Sequence[cst.EmptyLine] = ()
        for stmt in body:
            if id(stmt) in self._emptied:
                pending = pending or stmt.leading_lines
                continue
            if pending and not stmt.leading_lines:
                stmt = stmt.with_changes(leading_lines=pending)
            pending = ()
            out.append(stmt)
        return out

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        return updated_node.with_changes(body=self._drop_empty(updated_node.body))

    def leave_IndentedBlock(self, original_node, updated_node):
        body = self._drop_empty(updated_node.body) or [cst.SimpleStatementLine(body=[cst.Pass()])]
        return updated_node.with_changes(body=body)


class NameUses(cst.CSTVisitor):
    """Names read anywhere but in import statements."""

    def __init__(self):
        self.used: set[str] = set()

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def visit_Try(self, node: cst.Try) -> bool:
        # `try: import torch_npu / except ...: torch_npu = None`: a guard; its fallback binding is no use
        imports_only = all(isinstance(stmt, cst.SimpleStatementLine) and
                           all(isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body)
                           for stmt in node.body.body)
        return not imports_only

    def visit_Name(self, node: cst.Name) -> None:
        self.used.add(node.value)


DOCSTRING_LINE = m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString() | m.ConcatenatedString())])


IMPORT_LINE = m.SimpleStatementLine(body=[m.AtLeastN(m.Import() | m.ImportFrom(), n=1)])


IMPORT_TORCH_LINE = m.SimpleStatementLine(
    body=[m.ZeroOrMore(), m.Import(names=[m.ZeroOrMore(), m.ImportAlias(name=m.Name("torch")), m.ZeroOrMore()]),
          m.ZeroOrMore()]
)


TORCH_NPU = m.Attribute(value=m.Name("torch"), attr=m.Name("npu"))


TORCH_NPU_NPU = m.Attribute(value=m.Name("torch_npu"), attr=m.Name("npu"))


TORCH_CUDA = m.Attribute(value=m.Name("torch"), attr=m.Name("cuda"))


def device_ops_call(attr: str, *args: cst.Arg) -> cst.Call:
    return cst.Call(func=cst.Attribute(value=cst.Name("device_ops"), attr=cst.Name(attr)), args=list(args))


def bare_arg(arg: cst.Arg) -> cst.Arg:
    return arg.with_changes(comma=cst.MaybeSentinel.DEFAULT, keyword=None, equal=cst.MaybeSentinel.DEFAULT)


class DeviceOpsCommand(Command):
    """A command whose rewrites call engine.device_ops (the import is added when one is made)."""
    def _uses_device_ops(self) -> None:
        AddImportsVisitor.add_needed_import(self.context, "engine", "device_ops")


def attribute_to_device_ops(command: DeviceOpsCommand, original: cst.Attribute, updated: cst.Attribute,
                            owner: m.BaseMatcherNode, names: frozenset[str] | set[str]) -> cst.BaseExpression:
    """`<owner>.X` -> `device_ops.X` for X in `names` (torch.npu.synchronize, torch.cuda.Event, ...)."""
    if m.matches(original.value, owner) and original.attr.value in names:
        command._uses_device_ops()
        return cst.Attribute(value=cst.Name("device_ops"), attr=updated.attr)
    return updated
