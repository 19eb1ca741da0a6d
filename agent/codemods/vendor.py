"""LibCST codemods that turn a vendored transformers modeling file into recipe code.

A file such as ``transformers/models/llama/modeling_llama.py`` is copied to
``{recipe}/models/modeling_{name}.py``. The recipe directory is on ``PYTHONPATH`` and
``models`` is a namespace package, so the copy must import transformers absolutely and
its siblings as ``models.*``. The other codemods strip training-only code and add the
hooks the inference runner needs. Each codemod is one small, formatting-preserving
change; none of them touches the inference math.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor

logger = logging.getLogger(__name__)

__all__ = [
    "AbsoluteImportsCommand",
    "RunnerSettingsInitCommand",
    "GuardedTorchNpuImportCommand",
    "RemoveGradientCheckpointingCommand",
    "RemoveLabelsLossCommand",
    "PruneUnreachableDefinitionsCommand",
    "VendoredImportsCommand",
    "CODEMODS",
    "CodemodError",
    "RelativeImportError",
    "apply_codemods",
    "find_model_class_imports",
    "transformers_model_imports",
]


class CodemodError(Exception):
    """A codemod failed on a source file; the message names the codemod."""


class RelativeImportError(ValueError):
    """A relative import climbs above the top-level package it is resolved against."""


# --------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------

# Order in which libcst renders the fields of `Parameters`.
_PARAM_SLOTS = ("posonly_params", "posonly_ind", "params", "star_arg", "kwonly_params", "star_kwarg")
_LIST_SLOTS = {"posonly_params", "params", "kwonly_params"}


class _Command(VisitorBasedCodemodCommand):
    """Base of the codemods below: a VisitorBasedCodemodCommand without matcher decorators.

    None of these codemods uses `@m.visit`/`@m.leave` or `@m.call_if_*`, so the per-node decorator
    bookkeeping of MatcherDecoratableTransformer is skipped: it made each pass ~10x slower.
    """

    @contextmanager
    def _handle_metadata_reference(self, module: cst.Module) -> Iterator[cst.Module]:
        # No codemod here declares METADATA_DEPENDENCIES, so skip the deep copy MetadataWrapper
        # makes of the whole tree on every pass (a third of the run time on large files).
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


def _flatten_params(params: cst.Parameters) -> list[tuple[str, cst.CSTNode]]:
    items: list[tuple[str, cst.CSTNode]] = []
    for slot in _PARAM_SLOTS:
        value = getattr(params, slot)
        if slot in _LIST_SLOTS:
            items.extend((slot, node) for node in value)
        elif value is not None and not isinstance(value, cst.MaybeSentinel):
            items.append((slot, value))
    return items


def _unflatten_params(params: cst.Parameters, items: list[tuple[str, cst.CSTNode]]) -> cst.Parameters:
    changes: dict[str, object] = {slot: [] for slot in _LIST_SLOTS}
    changes.update(posonly_ind=cst.MaybeSentinel.DEFAULT, star_arg=cst.MaybeSentinel.DEFAULT, star_kwarg=None)
    for slot, node in items:
        if slot in _LIST_SLOTS:
            changes[slot].append(node)
        else:
            changes[slot] = node
    return params.with_changes(**changes)


def _separator(items: Sequence[tuple[str, cst.CSTNode]], index: int) -> cst.Comma:
    """The comma used between elements near `index` (keeps one-line vs. one-per-line style)."""
    for _, node in reversed(items[: index + 1]):
        if isinstance(node.comma, cst.Comma):
            return node.comma
    return cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))


def _insert_param(params: cst.Parameters, slot: str, new: cst.Param) -> cst.Parameters:
    items = _flatten_params(params)
    order = _PARAM_SLOTS.index(slot)
    pos = sum(1 for s, _ in items if _PARAM_SLOTS.index(s) <= order)
    if pos == len(items) and items:
        # Appending: the new last element inherits the old last one's trailing comma and the
        # whitespace before ")" so a one-per-line signature stays one-per-line.
        last_slot, last = items[-1]
        sep = _separator(items, len(items) - 2) if len(items) > 1 else _separator([], 0)
        new = new.with_changes(comma=last.comma)
        if isinstance(last, cst.Param):
            new = new.with_changes(whitespace_after_param=last.whitespace_after_param)
            last = last.with_changes(whitespace_after_param=cst.SimpleWhitespace(""))
        items[-1] = (last_slot, last.with_changes(comma=sep))
    else:
        new = new.with_changes(comma=_separator(items, pos - 1) if pos else cst.MaybeSentinel.DEFAULT)
    items.insert(pos, (slot, new))
    return _unflatten_params(params, items)


def _remove_param(params: cst.Parameters, name: str) -> cst.Parameters:
    items = _flatten_params(params)
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
    return _unflatten_params(params, items)


def _param_names(params: cst.Parameters) -> list[str]:
    return [n.name.value for _, n in _flatten_params(params) if isinstance(n, cst.Param)]


def _remove_from_sequence(elements: Sequence[cst.CSTNode], keep: Callable[[cst.CSTNode], bool]) -> list:
    """Drop elements of a comma-separated sequence (call args, import aliases), fixing the last comma."""
    kept = [e for e in elements if keep(e)]
    if kept and not keep(elements[-1]):
        kept[-1] = kept[-1].with_changes(comma=elements[-1].comma)
    return kept


def _truth(expr: cst.BaseExpression, leaf: Callable[[cst.BaseExpression], bool | None]) -> bool | None:
    """Static truth value of a condition given what `leaf` knows (None when unknown)."""
    if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Not):
        inner = _truth(expr.expression, leaf)
        return None if inner is None else not inner
    if isinstance(expr, cst.BooleanOperation):
        left, right = _truth(expr.left, leaf), _truth(expr.right, leaf)
        if isinstance(expr.operator, cst.And):
            if left is False or right is False:
                return False
            return True if left and right else None
        if left is True or right is True:
            return True
        return False if left is False and right is False else None
    return leaf(expr)


def _as_statements(suite: cst.BaseSuite) -> list[cst.BaseStatement]:
    if isinstance(suite, cst.IndentedBlock):
        return list(suite.body)
    return [cst.SimpleStatementLine(body=list(suite.body))]


class _StaticBranchMixin:
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
            value = _truth(branch.test, self._leaf_truth)
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
            body = _as_statements(else_clause.body)
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
        value = _truth(updated_node.test, self._leaf_truth)
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


class _ScopeMixin:
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


def _name_of(expr: cst.BaseExpression) -> str | None:
    """Last component of `a.b.C` / `C`."""
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        return expr.attr.value
    return None


def _dotted(expr: cst.BaseExpression | None) -> str:
    if expr is None:
        return ""
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        return f"{_dotted(expr.value)}.{expr.attr.value}"
    raise ValueError(f"not a dotted name: {expr!r}")


# --------------------------------------------------------------------------------------
# 1. Relative imports -> absolute / sibling imports
# --------------------------------------------------------------------------------------


class AbsoluteImportsCommand(_Command):
    DESCRIPTION = "Rewrite relative imports to absolute ones, mapping vendored siblings to `models.*`."

    def __init__(self, context: CodemodContext, package: str, sibling_modules: dict[str, str] | None = None):
        super().__init__(context)
        self.package = package
        self.sibling_modules = dict(sibling_modules or {})

    def _base(self, dots: int) -> str:
        parts = self.package.split(".") if self.package else []
        # One dot is the package itself; every further dot goes one package up.
        if dots - 1 >= len(parts):
            raise RelativeImportError(
                f"relative import with {dots} dot(s) goes beyond the top-level package of {self.package!r}"
            )
        return ".".join(parts[: len(parts) - (dots - 1)])

    def _map(self, module: str) -> str:
        if module in self.sibling_modules:
            return self.sibling_modules[module]
        for key, target in self.sibling_modules.items():
            if module.startswith(key + "."):
                return target + module[len(key):]
        return module

    def _rewrite(self, node: cst.ImportFrom) -> list[cst.BaseSmallStatement]:
        base = self._base(len(node.relative))
        if node.module is not None:
            module = self._map(f"{base}.{_dotted(node.module)}")
            return [node.with_changes(relative=[], module=cst.parse_expression(module))]
        absolute = node.with_changes(relative=[], module=cst.parse_expression(base))
        if isinstance(node.names, cst.ImportStar):
            return [absolute]
        siblings = [a for a in node.names if f"{base}.{a.name.value}" in self.sibling_modules]
        if not siblings:
            return [absolute]
        # `from . import configuration_llama` where that module is vendored under another name:
        # import the vendored module but keep the local name the code uses.
        out: list[cst.BaseSmallStatement] = []
        rest = _remove_from_sequence(node.names, lambda a: a not in siblings)
        if rest:
            out.append(absolute.with_changes(names=rest))
        for alias in siblings:
            target = self.sibling_modules[f"{base}.{alias.name.value}"]
            local = alias.asname.name.value if alias.asname else alias.name.value
            parent, _, leaf = target.rpartition(".")
            asname = None if local == (leaf if parent else target) else cst.AsName(name=cst.Name(local))
            if parent:
                out.append(
                    cst.ImportFrom(
                        module=cst.parse_expression(parent),
                        names=[cst.ImportAlias(name=cst.Name(leaf), asname=asname)],
                    )
                )
            else:
                out.append(cst.Import(names=[cst.ImportAlias(name=cst.Name(target), asname=asname)]))
        return out

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> bool:
        return False  # imports are whole statements: no need to walk expressions

    def leave_ImportFrom(self, original_node: cst.ImportFrom, updated_node: cst.ImportFrom):
        # Only reached inside one-line suites (`if TYPE_CHECKING: from .x import y`); lines are
        # rewritten as a whole below so that a split import gets one line per statement.
        if not updated_node.relative:
            return updated_node
        out = self._rewrite(updated_node)
        return out[0] if len(out) == 1 else cst.FlattenSentinel(out)

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ):
        if not any(m.matches(s, m.ImportFrom(relative=[m.AtLeastN(n=1)])) for s in updated_node.body):
            return updated_node
        body: list[cst.BaseSmallStatement] = []
        for stmt in updated_node.body:
            if isinstance(stmt, cst.ImportFrom) and stmt.relative:
                body.extend(self._rewrite(stmt))
            else:
                body.append(stmt)
        if len(updated_node.body) == 1 and len(body) > 1:
            # A split import becomes one line per statement rather than `a; b`.
            lines = [cst.SimpleStatementLine(body=[s]) for s in body]
            lines[0] = lines[0].with_changes(leading_lines=updated_node.leading_lines)
            lines[-1] = lines[-1].with_changes(trailing_whitespace=updated_node.trailing_whitespace)
            return cst.FlattenSentinel(lines)
        return updated_node.with_changes(body=body)


# --------------------------------------------------------------------------------------
# 2. Model __init__ accepts runner_settings / **kwargs
# --------------------------------------------------------------------------------------

_MODEL_CLASS_SUFFIXES = ("PreTrainedModel", "Model", "ForCausalLM")


def _is_model_class(node: cst.ClassDef) -> bool:
    if node.name.value.endswith(_MODEL_CLASS_SUFFIXES):
        return True
    return any((_name_of(arg.value) or "").endswith(("PreTrainedModel", "Model")) for arg in node.bases)


class RunnerSettingsInitCommand(_ScopeMixin, _Command):
    DESCRIPTION = "Let model classes' __init__(self, config) also accept runner_settings=None and **kwargs."

    def __init__(self, context: CodemodContext):
        super().__init__(context)
        self._init_scopes()

    @staticmethod
    def _patch_init(func: cst.FunctionDef) -> cst.FunctionDef:
        params = func.params
        names = _param_names(params)
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
        params = _insert_param(params, slot, runner)
        if params.star_kwarg is None:
            params = _insert_param(params, "star_kwarg", cst.Param(name=cst.Name("kwargs"), star="**"))
        return func.with_changes(params=params, body=RunnerSettingsInitCommand._document(func.body))

    @staticmethod
    def _document(body: cst.BaseSuite) -> cst.BaseSuite:
        """Document runner_settings: transformers' @auto_docstring prints an error for every
        undocumented __init__ argument each time the module is imported."""
        if not isinstance(body, cst.IndentedBlock) or (body.body and m.matches(body.body[0], _DOCSTRING_LINE)):
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
        if self._scopes or not _is_model_class(updated_node):
            return updated_node
        if not isinstance(updated_node.body, cst.IndentedBlock):
            return updated_node
        body = [
            self._patch_init(s) if m.matches(s, m.FunctionDef(name=m.Name("__init__"))) else s
            for s in updated_node.body.body
        ]
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))


# --------------------------------------------------------------------------------------
# 3. Guarded `import torch_npu`
# --------------------------------------------------------------------------------------

_TORCH_NPU_ALIAS = m.ImportAlias(name=m.Name("torch_npu"))
_IMPORTS_TORCH_NPU = m.Import(names=[m.ZeroOrMore(), _TORCH_NPU_ALIAS, m.ZeroOrMore()])
_BARE_TORCH_NPU_LINE = m.SimpleStatementLine(
    body=[m.Import(names=[m.ImportAlias(name=m.Name("torch_npu"), asname=None)])]
)
_IMPORT_TORCH_LINE = m.SimpleStatementLine(
    body=[m.ZeroOrMore(), m.Import(names=[m.ZeroOrMore(), m.ImportAlias(name=m.Name("torch")), m.ZeroOrMore()]),
          m.ZeroOrMore()]
)
_IMPORT_LINE = m.SimpleStatementLine(body=[m.AtLeastN(m.Import() | m.ImportFrom(), n=1)])
_DOCSTRING_LINE = m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString() | m.ConcatenatedString())])


class GuardedTorchNpuImportCommand(_Command):
    DESCRIPTION = "Import torch_npu right after torch, guarded so the module still loads without it."

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False  # only module-level statements matter

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    @staticmethod
    def _guarded(module: cst.Module) -> cst.Try:
        indent, newline = module.default_indent, module.default_newline
        code = (
            f"try:{newline}"
            f'{indent}import torch_npu  # noqa: F401  registers the "npu" device with torch{newline}'
            f"except Exception:  # not installed, or installed without the CANN runtime{newline}"
            f"{indent}torch_npu = None{newline}"
        )
        return cst.parse_statement(code, config=module.config_for_parsing)

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        body = list(updated_node.body)
        for i, stmt in enumerate(body):
            if isinstance(stmt, cst.Try) and m.findall(stmt.body, _IMPORTS_TORCH_NPU):
                return updated_node  # already guarded
            if m.matches(stmt, _BARE_TORCH_NPU_LINE):
                # A hard `import torch_npu` would make the recipe unimportable on CPU/CUDA hosts.
                body[i] = self._guarded(updated_node).with_changes(leading_lines=stmt.leading_lines)
                return updated_node.with_changes(body=body)
            if m.matches(stmt, m.SimpleStatementLine(body=[m.ZeroOrMore(), _IMPORTS_TORCH_NPU, m.ZeroOrMore()])):
                return updated_node  # imported in some other form (alias, several names): leave it
        index = next((i + 1 for i, s in enumerate(body) if m.matches(s, _IMPORT_TORCH_LINE)), None)
        if index is None:
            # After the leading block of imports (and a module docstring).
            index = 0
            for i, stmt in enumerate(body):
                if m.matches(stmt, _IMPORT_LINE) or (i == 0 and m.matches(stmt, _DOCSTRING_LINE)):
                    index = i + 1
                else:
                    break
        body.insert(index, self._guarded(updated_node))
        return updated_node.with_changes(body=body)


# --------------------------------------------------------------------------------------
# 4. Gradient checkpointing (training only)
# --------------------------------------------------------------------------------------

_SELF_GC = m.Attribute(value=m.Name("self"), attr=m.Name("gradient_checkpointing"))
_SELF_GC_ASSIGN = m.Assign(targets=[m.AssignTarget(target=_SELF_GC)]) | m.AnnAssign(target=_SELF_GC)
_SUPPORTS_GC_ASSIGN = m.Assign(
    targets=[m.AssignTarget(target=m.Name("supports_gradient_checkpointing"))]
) | m.AnnAssign(target=m.Name("supports_gradient_checkpointing"))
_GC_LAYER = "GradientCheckpointingLayer"


class _NameCounter(cst.CSTVisitor):
    """Counts the `Name` nodes spelling `name`, and how many of them are `from x import name`."""

    def __init__(self, name: str):
        super().__init__()
        self.name, self.uses, self.imported = name, 0, 0

    def visit_Name(self, node: cst.Name) -> None:
        self.uses += node.value == self.name

    def visit_ImportAlias(self, node: cst.ImportAlias) -> None:
        self.imported += isinstance(node.name, cst.Name) and node.name.value == self.name


class _DropImportedName(cst.CSTTransformer):
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
                names = _remove_from_sequence(stmt.names, lambda a, stmt=stmt: not self._drops(stmt, a))
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


class RemoveGradientCheckpointingCommand(_StaticBranchMixin, _ScopeMixin, _Command):
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
        body = [
            s for s in updated_node.body
            if not (m.matches(s, _SELF_GC_ASSIGN) or (in_class and m.matches(s, _SUPPORTS_GC_ASSIGN)))
        ]
        if len(body) == len(updated_node.body):
            return updated_node
        if not body:
            return cst.RemovalSentinel.REMOVE
        body[-1] = body[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
        return updated_node.with_changes(body=body)

    def leave_ClassDef(self, original_node: cst.ClassDef, updated_node: cst.ClassDef) -> cst.ClassDef:
        self._scopes.pop()
        bases = list(updated_node.bases)
        for i, arg in enumerate(bases):
            if _name_of(arg.value) == _GC_LAYER and m.matches(arg.value, m.Name() | m.Attribute()):
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
        counter = _NameCounter(_GC_LAYER)
        updated_node.visit(counter)
        if counter.imported and counter.uses == counter.imported:
            updated_node = updated_node.visit(_DropImportedName(_GC_LAYER))
        leftover = _NameCounter("gradient_checkpointing")
        updated_node.visit(leftover)
        if leftover.uses:
            # e.g. `if self.gradient_checkpointing or x:` is left for a person to simplify.
            self.warn(f"{leftover.uses} reference(s) to gradient_checkpointing left in place")
        return updated_node


# --------------------------------------------------------------------------------------
# 5. labels / loss in forward (training only)
# --------------------------------------------------------------------------------------

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


class RemoveLabelsLossCommand(_StaticBranchMixin, _ScopeMixin, _Command):
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
            in_module_class and node.name.value == "forward" and "labels" in _param_names(node.params)
        )
        super().visit_FunctionDef(node)
        return self._pruning_active()  # nothing to do in other functions

    def leave_FunctionDef(self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef) -> cst.FunctionDef:
        self._scopes.pop()
        if self._active.pop():
            updated_node = updated_node.with_changes(params=_remove_param(updated_node.params, "labels"))
            leftover = _NameCounter("labels")
            updated_node.body.visit(leftover)
            if leftover.uses:
                # A use of `labels` this codemod does not understand; the code would fail on it.
                self.warn(f"{original_node.name.value}: `labels` still used after removing the parameter")
        return updated_node

    def leave_SimpleStatementLine(self, original_node, updated_node):
        if not self._pruning_active():
            return updated_node
        body = [s for s in updated_node.body if not m.matches(s, _LOSS_NONE_ASSIGN)]
        if len(body) == len(updated_node.body):
            return updated_node
        if not body:
            return cst.RemovalSentinel.REMOVE
        body[-1] = body[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)
        return updated_node.with_changes(body=body)

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if not self._pruning_active():
            return updated_node
        # `Output(loss=loss, ...)` and a pass-through `labels=labels` would reference removed names.
        drop = m.Arg(keyword=m.Name("loss"), value=m.Name("loss")) | m.Arg(
            keyword=m.Name("labels"), value=m.Name("labels")
        )
        args = _remove_from_sequence(updated_node.args, lambda a: not m.matches(a, drop))
        # `self.pred_layer(hidden_states, labels)` / `head(x, target=labels)`: the callee gets what
        # `labels` always was at inference, None (XLM's XLMPredLayer.forward(x, y=None)).
        passed = m.Arg(value=m.Name("labels"), star="")
        args = [a.with_changes(value=cst.Name("None")) if m.matches(a, passed) else a for a in args]
        if args == list(updated_node.args):
            return updated_node
        return updated_node.with_changes(args=args)


# --------------------------------------------------------------------------------------
# 6. Definitions the kept model classes do not use
# --------------------------------------------------------------------------------------

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


class _DropUnusedImports(_DropImportedName):
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
        module = _dotted(stmt.module) if stmt.module is not None else ""
        if not stmt.relative and (module == "__future__" or module.split(".")[0] == "torch_npu"):
            return False
        bound = alias.asname.name if alias.asname is not None else alias.name
        return isinstance(bound, cst.Name) and bound.value in self.names and bound.value != "torch_npu"


class PruneUnreachableDefinitionsCommand(_Command):
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

            elements = _remove_from_sequence(value.elements, keep)
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


# --------------------------------------------------------------------------------------
# 7. Absolute imports of modules that are vendored too
# --------------------------------------------------------------------------------------


class VendoredImportsCommand(_Command):
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
        target = self.vendored.get(_dotted(updated_node.module))
        if target is None:
            return updated_node
        return updated_node.with_changes(module=cst.parse_expression(target))


# --------------------------------------------------------------------------------------
# 8. Vendored `_init_weights` runs as transformers' own
# --------------------------------------------------------------------------------------

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


class TransformersInitWeightsCommand(_Command):
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
        body.insert(at + 1, _NOT_CUSTOM_CODE.with_changes(leading_lines=[cst.EmptyLine()]))
        return updated_node.with_changes(body=updated_node.body.with_changes(body=body))


# --------------------------------------------------------------------------------------
# Driver and checks
# --------------------------------------------------------------------------------------

CODEMODS = [
    AbsoluteImportsCommand,
    RunnerSettingsInitCommand,
    GuardedTorchNpuImportCommand,
    RemoveGradientCheckpointingCommand,
    RemoveLabelsLossCommand,
    TransformersInitWeightsCommand,
]


def apply_codemods(
    source: str,
    package: str,
    sibling_modules: dict[str, str],
    codemods: Sequence[type[VisitorBasedCodemodCommand]] | None = None,
) -> tuple[str, list[str]]:
    """Run CODEMODS in order; return the new code and the names of the codemods that changed it.

    `codemods`, when given, is run instead of CODEMODS, in its order (e.g. without
    GuardedTorchNpuImportCommand for a configuration file). Each entry is a codemod class that
    takes only the context (AbsoluteImportsCommand also gets `package` and `sibling_modules`,
    VendoredImportsCommand gets `sibling_modules`).
    """
    try:
        tree = cst.parse_module(source)
    except cst.ParserSyntaxError as exc:
        raise CodemodError(f"cannot parse source: {exc}") from exc
    applied: list[str] = []
    code = tree.code
    for command in CODEMODS if codemods is None else codemods:
        context = CodemodContext(full_package_name=package)
        if command is AbsoluteImportsCommand:
            instance = command(context, package=package, sibling_modules=sibling_modules)
        elif command is VendoredImportsCommand:
            instance = command(context, vendored=sibling_modules)
        else:
            instance = command(context)
        try:
            new_tree = instance.transform_module(tree)
        except Exception as exc:
            raise CodemodError(f"{command.__name__} failed: {exc}") from exc
        for warning in context.warnings:
            logger.warning("%s: %s", command.__name__, warning)
        new_code = new_tree.code
        if new_code != code:
            applied.append(command.__name__)
        tree, code = new_tree, new_code
    return code, applied


def _is_model_class_object(obj: object) -> bool:
    import torch
    from transformers import PreTrainedConfig
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    # Auto classes are not modules but build model classes, so they count as model classes too;
    # a configuration class of another model is part of that model's implementation as well.
    return isinstance(obj, type) and issubclass(obj, (torch.nn.Module, _BaseAutoModelClass, PreTrainedConfig))


def find_model_class_imports(source: str) -> list[str]:
    """Return "module.Name" for each model or configuration class imported from a
    `transformers.models.*` module (anywhere in the file, also inside functions)."""
    found: list[str] = []
    for node in m.findall(cst.parse_module(source), m.ImportFrom(relative=[])):
        module = _dotted(node.module)
        if not module.startswith("transformers.models.") or isinstance(node.names, cst.ImportStar):
            continue
        try:
            imported = importlib.import_module(module)
        except Exception:  # noqa: BLE001 - missing optional dependency, broken module, ...
            continue  # cannot be resolved here; the import check of the recipe will report it
        for alias in node.names:
            name = _dotted(alias.name)
            qualified = f"{module}.{name}"
            if _is_model_class_object(getattr(imported, name, None)) and qualified not in found:
                found.append(qualified)
    return found


def transformers_model_imports(source: str) -> dict[str, list[str]]:
    """Modules of model implementations a file imports absolutely, with the names it takes.

    ``{"transformers.models.llama.configuration_llama": ["LlamaConfig"]}``: every
    `from transformers.models.<model>.<module> import ...` anywhere in the file, except the auto
    registry (`transformers.models.auto.*`), which maps names to classes and is no model's code.
    """
    found: dict[str, list[str]] = {}
    for node in m.findall(cst.parse_module(source), m.ImportFrom(relative=[])):
        module = _dotted(node.module)
        parts = module.split(".")
        if len(parts) < 4 or parts[:2] != ["transformers", "models"] or parts[2] == "auto":
            continue
        names = found.setdefault(module, [])
        if not isinstance(node.names, cst.ImportStar):
            names.extend(_dotted(a.name) for a in node.names if _dotted(a.name) not in names)
    return found
