"""One self-contained modeling file from the code files of a composition's parts (agent/recipe/native/parts/code/),
as transformers' modular converter inlines its parents: `write(composition, ctx) -> str`.

The code files are plain Python, importable under the stand-in with a cann-recipes-infer checkout on sys.path.
They name the family's classes with the placeholder prefix `Model` (`ModelRMSNorm`, `ModelForCausalLM`) and
refer to another slot's class through a role, a relative import's alias (`from .norm_rms import ModelRMSNorm as
Norm`): the assembler binds each role to the class of the part the composition chose for its slot. A part's
generation-time choices are module-level constants of its code file (`SINKS = False`; a file may import one a
sibling declares, `from .layer import NORM_EPS`, for one default); the assembler substitutes the composition's
values and folds what they decide:

* `if` / `elif` / conditional expressions / `and` / `or` / `not` / comparisons of constants, a `for` over an empty
  literal, statements after a `return` or `raise`;
* `getattr(x, "name")` -> `x.name`, `setattr(x, "name", v)` -> `x.name = v`, `**{"k": v}` -> `k=v`, `**{}` -> nothing,
  literals inside f-strings, `"a" + "b"`;
* a class whose only use is as the base of another is merged into it (its `super().__init__(...)` inlined);
* what nothing uses any more — module-level definitions, private methods, imports — is dropped, to a fixpoint.

An option whose value is a non-empty tuple stays a module constant (a table the file reads); an `Expr` option is
written as code (`config.attention_bias`). The result gets the licence header and a module docstring, and is
checked to compile.
"""

from __future__ import annotations

import json
import re
import sys
from functools import lru_cache
from pathlib import Path

import libcst as cst
from libcst import MaybeSentinel

from agent.recipe.native.parts.part import Expr  # noqa: F401 - an option written as code, importable from here

CODE_DIR = Path(__file__).resolve().parent / "parts" / "code"
PLACEHOLDER = "Model"
ROLES = ("Norm", "RotaryEmbedding", "Attention", "MLP", "SparseMoeBlock", "DecoderLayer", "LinearAttention")
LOCAL_PACKAGES = ("executor", "module")        # the checkout's packages: the last import group
_UNKNOWN = object()
ATOMS = (cst.Name, cst.Attribute, cst.Call, cst.Subscript, cst.SimpleString, cst.Integer, cst.Float, cst.Dict,
         cst.List, cst.Tuple)


class AssembleError(Exception):
    """The code files and the composition do not make one file (a bug of a part, not of the user's input)."""


# ---- reading the code files ------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _parse_path(path: Path) -> cst.Module:
    if not path.is_file():
        raise AssembleError(f"no code file {path.name} under {path.parent}")
    return cst.parse_module(path.read_text())


def _is_docstring(stmt) -> bool:
    return (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Expr)
            and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString)))


def _dotted(node) -> str:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return f"{_dotted(node.value)}.{node.attr.value}"
    raise AssembleError(f"unexpected import target {node!r}")


def _relative_imports(module: cst.Module) -> list[tuple[str, str, str]]:
    """(file, imported name, local name) of each `from .file import name [as local]`."""
    found = []
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, cst.ImportFrom) and small.relative:
                    if small.module is None or isinstance(small.names, cst.ImportStar):
                        raise AssembleError("code files import siblings by name: from .file import Name")
                    for alias in small.names:
                        local = alias.asname.name.value if alias.asname else alias.name.value
                        found.append((f"{_dotted(small.module)}.py", alias.name.value, local))
    return found


def file_order(files: list[str], code_dir: Path = CODE_DIR) -> list[str]:
    """`files` with the siblings they import concretely (not as a role), each after what it imports."""
    order: list[str] = []

    def _parse(name):
        return _parse_path(code_dir / name)

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in order:
            return
        if name in path:
            raise AssembleError(f"code files import each other: {' -> '.join(path + (name,))}")
        for dep, _, local in _relative_imports(_parse(name)):
            if local not in ROLES:
                visit(dep, path + (name,))
        order.append(name)

    for name in files:
        visit(name, ())
    return order


# ---- constants ------------------------------------------------------------------------------------
def source(value) -> str:
    """Python source of a literal, strings double-quoted (upstream's style)."""
    if isinstance(value, str):
        return json.dumps(value) if value.isascii() else repr(value)
    if isinstance(value, (bool, type(None), int, float)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        items = ", ".join(source(v) for v in value)
        if isinstance(value, list):
            return f"[{items}]"
        return f"({items},)" if len(value) == 1 else f"({items})"
    raise AssembleError(f"option value {value!r}: not a literal, tuple or Expr")


def literal(value) -> cst.BaseExpression:
    """The libcst expression of an option's value."""
    if isinstance(value, Expr):
        return cst.parse_expression(value.code)
    return cst.parse_expression(source(value))


def _const(node):
    """The value of a constant expression, or _UNKNOWN."""
    if isinstance(node, (cst.SimpleString, cst.Integer, cst.Float)):
        try:
            return node.evaluated_value
        except Exception:  # noqa: BLE001 - a form evaluated_value does not take: not a constant here
            return _UNKNOWN
    if isinstance(node, cst.Name) and node.value in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[node.value]
    if isinstance(node, (cst.Tuple, cst.List)):
        values = [_const(el.value) for el in node.elements if not isinstance(el, cst.StarredElement)]
        if len(values) != len(node.elements) or any(v is _UNKNOWN for v in values):
            return _UNKNOWN
        return tuple(values)
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Not):
        value = _const(node.expression)
        return _UNKNOWN if value is _UNKNOWN else (not value)
    if isinstance(node, cst.BooleanOperation):
        left, right = _const(node.left), _const(node.right)
        if left is _UNKNOWN or right is _UNKNOWN:
            return _UNKNOWN
        return (left and right) if isinstance(node.operator, cst.And) else (left or right)
    if isinstance(node, cst.Comparison):
        left = _const(node.left)
        if left is _UNKNOWN:
            return _UNKNOWN
        result = True
        for target in node.comparisons:
            right = _const(target.comparator)
            if right is _UNKNOWN:
                return _UNKNOWN
            op = type(target.operator).__name__
            compare = {"Equal": lambda a, b: a == b, "NotEqual": lambda a, b: a != b, "In": lambda a, b: a in b,
                       "NotIn": lambda a, b: a not in b, "Is": lambda a, b: a is b, "IsNot": lambda a, b: a is not b}
            if op not in compare:
                return _UNKNOWN
            result = result and compare[op](left, right)
            left = right
        return result
    return _UNKNOWN


def _name_of(value) -> bool:
    return isinstance(value, str) and value.isidentifier()


# ---- transforms --------------------------------------------------------------------------------------
class _Rename(cst.CSTTransformer):
    """Names (in load / reference position) replaced by expressions: options' values, roles' classes."""

    def __init__(self, values: dict[str, cst.BaseExpression]):
        self.values = values

    def leave_Name(self, original, updated):
        return self.values.get(updated.value, updated)

    def leave_Attribute(self, original, updated):
        return updated.with_changes(attr=original.attr)

    def leave_Arg(self, original, updated):
        return updated.with_changes(keyword=original.keyword)

    def leave_Param(self, original, updated):
        return updated.with_changes(name=original.name)

    def leave_FunctionDef(self, original, updated):
        return updated.with_changes(name=original.name)

    def leave_ClassDef(self, original, updated):
        return updated.with_changes(name=original.name)

    def leave_AssignTarget(self, original, updated):
        return original if isinstance(original.target, cst.Name) else updated


def _truth(node):
    """The truth of a test (a condition's value need only be true or false): True, False or _UNKNOWN."""
    if isinstance(node, cst.BooleanOperation):
        left, right = _truth(node.left), _truth(node.right)
        if isinstance(node.operator, cst.And):
            return False if False in (left, right) else True if (left, right) == (True, True) else _UNKNOWN
        return True if True in (left, right) else False if (left, right) == (False, False) else _UNKNOWN
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Not):
        value = _truth(node.expression)
        return _UNKNOWN if value is _UNKNOWN else not value
    value = _const(node)
    return _UNKNOWN if value is _UNKNOWN else bool(value)


def _simplify_test(node):
    """A test without its constant operands that do not decide it (x and True -> x, x or False -> x)."""
    if isinstance(node, cst.BooleanOperation):
        left, right = _simplify_test(node.left), _simplify_test(node.right)
        keep = True if isinstance(node.operator, cst.And) else False
        if _truth(left) is keep:
            return right.with_changes(lpar=node.lpar, rpar=node.rpar) if node.lpar else right
        if _truth(right) is keep:
            return left.with_changes(lpar=node.lpar, rpar=node.rpar) if node.lpar else left
        return node.with_changes(left=left, right=right)
    return node


def _fold_if(node: cst.If) -> list:
    """The statements an `if` chain leaves: the branch its constant test takes, or the chain itself with its
    constant `elif`s folded."""
    value = _truth(node.test)
    if value is _UNKNOWN:
        node = node.with_changes(test=_simplify_test(node.test))
        orelse = node.orelse
        if isinstance(orelse, cst.If):
            rest = _fold_if(orelse)
            if rest == [orelse]:
                pass
            elif not rest:
                orelse = None
            elif len(rest) == 1 and isinstance(rest[0], cst.If):
                orelse = rest[0]
            else:
                orelse = cst.Else(body=cst.IndentedBlock(body=rest))
        return [node.with_changes(orelse=orelse)]
    if value:
        kept = list(node.body.body)
    elif isinstance(node.orelse, cst.Else):
        kept = list(node.orelse.body.body)
    elif isinstance(node.orelse, cst.If):
        kept = _fold_if(node.orelse)
    else:
        kept = []
    if kept:
        kept[0] = kept[0].with_changes(leading_lines=[*node.leading_lines, *kept[0].leading_lines])
    return kept


def _statement_call(stmt):
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Expr) \
            and isinstance(stmt.body[0].value, cst.Call):
        return stmt.body[0].value
    return None


def _terminates(stmt) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and any(isinstance(s, (cst.Return, cst.Raise)) for s in stmt.body)


def _fold_statements(body) -> list:
    out = []
    for stmt in body:
        if isinstance(stmt, cst.If):
            out.extend(_fold_if(stmt))
            continue
        if isinstance(stmt, cst.For) and _const(stmt.iter) == ():
            if stmt.orelse is not None:
                kept = list(stmt.orelse.body.body)
                if kept:
                    kept[0] = kept[0].with_changes(leading_lines=[*stmt.leading_lines, *kept[0].leading_lines])
                out.extend(kept)
            continue
        call = _statement_call(stmt)
        if call is not None and isinstance(call.func, cst.Name) and call.func.value == "setattr" and len(call.args) == 3:
            name = _const(call.args[1].value)
            if _name_of(name):
                target = cst.Attribute(value=call.args[0].value, attr=cst.Name(name))
                stmt = stmt.with_changes(body=[cst.Assign(targets=[cst.AssignTarget(target=target)],
                                                          value=call.args[2].value)])
        out.append(stmt)
    # nothing after a return / raise at the same level runs
    for index, stmt in enumerate(out):
        if _terminates(stmt):
            out = out[:index + 1]
            break
    return out


class _Fold(cst.CSTTransformer):
    """Constant folding and the peepholes the options leave (see the module docs)."""

    def leave_IndentedBlock(self, original, updated):
        body = _fold_statements(updated.body)
        if not body:
            body = [cst.SimpleStatementLine(body=[cst.Pass()])]
        return updated.with_changes(body=body)

    def leave_Module(self, original, updated):
        return updated.with_changes(body=_fold_statements(updated.body))

    def leave_IfExp(self, original, updated):
        value = _truth(updated.test)
        if value is _UNKNOWN:
            return updated.with_changes(test=_simplify_test(updated.test))
        chosen = updated.body if value else updated.orelse
        if isinstance(chosen, ATOMS):       # no precedence to keep: the parentheses go with the condition
            return chosen
        return chosen.with_changes(lpar=updated.lpar, rpar=updated.rpar)

    def leave_BooleanOperation(self, original, updated):
        left = _const(updated.left)
        if left is _UNKNOWN:
            return updated
        is_and = isinstance(updated.operator, cst.And)
        if bool(left) is not is_and:       # False and x / True or x: the left operand is the value
            return updated.left
        return updated.right.with_changes(lpar=updated.lpar or updated.right.lpar,
                                          rpar=updated.rpar or updated.right.rpar)

    def leave_UnaryOperation(self, original, updated):
        value = _const(updated)
        if value is _UNKNOWN or not isinstance(updated.operator, cst.Not):
            return updated
        return cst.Name("True" if value else "False")

    def leave_Comparison(self, original, updated):
        value = _const(updated)
        return updated if value is _UNKNOWN else cst.Name("True" if value else "False")

    def leave_Subscript(self, original, updated):
        value = _const(updated.value)
        if isinstance(value, tuple) and len(updated.slice) == 1 and isinstance(updated.slice[0].slice, cst.Index):
            index = _const(updated.slice[0].slice.value)
            if isinstance(index, int) and not isinstance(index, bool) and -len(value) <= index < len(value):
                return literal(value[index])
        return updated

    def leave_BinaryOperation(self, original, updated):
        left, right = _const(updated.left), _const(updated.right)
        if isinstance(updated.operator, cst.Add) and isinstance(left, str) and isinstance(right, str):
            return cst.SimpleString(repr(left + right))
        return updated

    def leave_Call(self, original, updated):
        func = updated.func
        if isinstance(func, cst.Name) and func.value == "getattr" and len(updated.args) == 2 \
                and updated.args[0].keyword is None:
            name = _const(updated.args[1].value)
            if _name_of(name):
                return cst.Attribute(value=updated.args[0].value, attr=cst.Name(name))
        if not any(arg.star == "**" for arg in updated.args):
            return updated
        args = []
        for arg in updated.args:
            if arg.star == "**" and isinstance(arg.value, cst.Dict):
                keys = [_const(el.key) if isinstance(el, cst.DictElement) else _UNKNOWN for el in arg.value.elements]
                if all(_name_of(k) for k in keys):
                    for key, element in zip(keys, arg.value.elements):
                        args.append(cst.Arg(value=element.value, keyword=cst.Name(key),
                                            equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                                                  whitespace_after=cst.SimpleWhitespace("")),
                                            comma=arg.comma if element is arg.value.elements[-1]
                                            else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))))
                    continue
            args.append(arg)
        if args and len(args) < len(updated.args) and updated.args[-1].comma is MaybeSentinel.DEFAULT:
            args[-1] = args[-1].with_changes(comma=MaybeSentinel.DEFAULT)
        return updated.with_changes(args=args)

    def leave_FormattedString(self, original, updated):
        parts, changed = [], False
        for part in updated.parts:
            value = _const(part.expression) if isinstance(part, cst.FormattedStringExpression) \
                and part.conversion is None and part.format_spec is None else _UNKNOWN
            if isinstance(value, (str, int)) and not isinstance(value, bool):
                text = str(value).replace("{", "{{").replace("}", "}}")
                quote = updated.end
                if quote in text or "\\" in text or "\n" in text:
                    parts.append(part)
                    continue
                parts.append(cst.FormattedStringText(text))
                changed = True
            else:
                parts.append(part)
        if not changed:
            return updated
        merged = []
        for part in parts:
            if merged and isinstance(part, cst.FormattedStringText) and isinstance(merged[-1], cst.FormattedStringText):
                merged[-1] = cst.FormattedStringText(merged[-1].value + part.value)
            else:
                merged.append(part)
        if all(isinstance(p, cst.FormattedStringText) for p in merged):
            text = "".join(p.value for p in merged).replace("{{", "{").replace("}}", "}")
            return cst.SimpleString(updated.start.lstrip("fF") + text + updated.end, lpar=updated.lpar, rpar=updated.rpar)
        return updated.with_changes(parts=merged)


def fold(module: cst.Module) -> cst.Module:
    while True:
        folded = module.visit(_Fold())
        if folded.deep_equals(module):
            return folded
        module = folded


# ---- attributes that hold a constant -----------------------------------------------------------------
def _self_attr(node) -> str | None:
    if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value == "self":
        return node.attr.value
    return None


class _AttrWrites(cst.CSTVisitor):
    def __init__(self):
        self.writes: dict[str, int] = {}
        self.outside: set[str] = set()      # attributes read off something other than self

    def _target(self, node):
        elements = node.elements if isinstance(node, (cst.Tuple, cst.List)) else [cst.Element(value=node)]
        for element in elements:
            name = _self_attr(element.value)
            if name:
                self.writes[name] = self.writes.get(name, 0) + 1

    def visit_AssignTarget(self, node):
        self._target(node.target)

    def visit_AugAssign(self, node):
        self._target(node.target)

    def visit_AnnAssign(self, node):
        self._target(node.target)

    def visit_Attribute(self, node):
        if _self_attr(node) is None:
            self.outside.add(node.attr.value)


class _ReplaceAttrs(cst.CSTTransformer):
    def __init__(self, values: dict[str, cst.BaseExpression]):
        self.values = values

    def leave_Attribute(self, original, updated):
        name = _self_attr(updated)
        return self.values[name] if name in self.values else updated


def propagate(module: cst.Module) -> cst.Module:
    """`self.x = True / False` in a class's __init__, never written again nor read off another object: its reads
    become the constant and the assignment goes (an option's switch then folds where it is used)."""
    outside = _AttrWrites()
    module.visit(outside)
    body = []
    for stmt in module.body:
        if isinstance(stmt, cst.ClassDef):
            writes = _AttrWrites()
            stmt.visit(writes)
            init = next((m for m in stmt.body.body if isinstance(m, cst.FunctionDef) and m.name.value == "__init__"), None)
            values, assignments = {}, []
            for line in (init.body.body if init is not None else []):
                if isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1 and isinstance(line.body[0], cst.Assign) \
                        and len(line.body[0].targets) == 1:
                    name = _self_attr(line.body[0].targets[0].target)
                    if name and writes.writes.get(name) == 1 and name not in outside.outside \
                            and isinstance(_const(line.body[0].value), bool):
                        values[name] = line.body[0].value
                        assignments.append(line)
            if values:
                init_body = [line for line in init.body.body if not any(line is a for a in assignments)]
                members = [m.with_changes(body=m.body.with_changes(body=init_body)) if m is init else m
                           for m in stmt.body.body]
                stmt = stmt.with_changes(body=stmt.body.with_changes(body=members)).visit(_ReplaceAttrs(values))
        body.append(stmt)
    return module.with_changes(body=body)


# ---- merging a class into the one that extends it ----------------------------------------------------------
class _Names(cst.CSTVisitor):
    def __init__(self):
        self.names: list[str] = []
        self.attrs: set[str] = set()

    def visit_Name(self, node):
        self.names.append(node.value)

    def visit_Attribute(self, node):
        self.attrs.add(node.attr.value)
        node.value.visit(self)
        return False

    def visit_Arg(self, node):
        node.value.visit(self)
        return False

    def visit_Param(self, node):
        if node.default is not None:
            node.default.visit(self)
        if node.annotation is not None:
            node.annotation.visit(self)
        return False

    def visit_FunctionDef(self, node):
        for part in (node.params, node.body, *node.decorators):
            part.visit(self)
        if node.returns is not None:
            node.returns.visit(self)
        return False

    def visit_ClassDef(self, node):
        for part in (*node.bases, *node.keywords, node.body, *node.decorators):
            part.visit(self)
        return False

    def visit_AssignTarget(self, node):
        if not isinstance(node.target, cst.Name):
            node.target.visit(self)
        return False


def _names(node) -> _Names:
    seen = _Names()
    node.visit(seen)
    return seen


def _defined(stmt) -> list[str]:
    if isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
        return [stmt.name.value]
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign):
        names = []
        for target in stmt.body[0].targets:
            t = target.target
            elements = t.elements if isinstance(t, cst.Tuple) else [cst.Element(value=t)]
            names += [e.value.value for e in elements if isinstance(e.value, cst.Name)]
        return names
    return []


def _super_call(stmt, method: str):
    """The call of `super().<method>(...)` that `stmt` is, or None."""
    call = _statement_call(stmt)
    if call is None or not isinstance(call.func, cst.Attribute) or call.func.attr.value != method:
        return None
    inner = call.func.value
    if isinstance(inner, cst.Call) and isinstance(inner.func, cst.Name) and inner.func.value == "super":
        return call
    return None


def _param_names(function: cst.FunctionDef) -> list[str]:
    return [p.name.value for p in function.params.params]


class _SuperToSelf(cst.CSTTransformer):
    """In a subclass's own code: super().m -> self.m for a base method m the subclass does not override
    (super().__init__ is inlined by _inline_init)."""

    def __init__(self, allowed: set[str]):
        self.allowed = allowed

    def leave_Attribute(self, original, updated):
        inner = updated.value
        if isinstance(inner, cst.Call) and isinstance(inner.func, cst.Name) and inner.func.value == "super" \
                and updated.attr.value != "__init__":
            if updated.attr.value not in self.allowed:
                raise AssembleError(f"super().{updated.attr.value} of a method the subclass overrides: not merged")
            return updated.with_changes(value=cst.Name("self"))
        return updated


def _merge(base: cst.ClassDef, sub: cst.ClassDef) -> cst.ClassDef:
    """`sub` with `base`'s body merged in: base's methods in their order, each replaced by sub's override (sub's
    `__init__` calling `super().__init__(...)` with base's parameters gets base's body there), then sub's own."""
    def members(cls):
        body = list(cls.body.body)
        doc = body.pop(0) if body and _is_docstring(body[0]) else None
        return doc, body

    base_doc, base_body = members(base)
    sub_doc, sub_body = members(sub)
    base_methods = {m.name.value: m for m in base_body if isinstance(m, cst.FunctionDef)}
    overridden = {m.name.value for m in sub_body if isinstance(m, cst.FunctionDef)}
    sub_body = [m.visit(_SuperToSelf(set(base_methods) - overridden)) for m in sub_body]
    overrides = {m.name.value: m for m in sub_body if isinstance(m, cst.FunctionDef)}
    merged, used = [], set()
    for member in base_body:
        if isinstance(member, cst.FunctionDef) and member.name.value in overrides:
            override = overrides[member.name.value]
            used.add(member.name.value)
            if member.name.value == "__init__":
                override = _inline_init(member, override)
            merged.append(override)
        else:
            merged.append(member)
    merged += [m for m in sub_body if not (isinstance(m, cst.FunctionDef) and m.name.value in used)]
    body = ([sub_doc] if sub_doc is not None else [base_doc] if base_doc is not None else []) + merged
    return sub.with_changes(bases=base.bases, body=sub.body.with_changes(body=body))


def _inline_init(base_init: cst.FunctionDef, sub_init: cst.FunctionDef) -> cst.FunctionDef:
    params = _param_names(base_init)[1:]
    body = list(sub_init.body.body)
    doc = body.pop(0) if body and _is_docstring(body[0]) else None
    index = next((i for i, s in enumerate(body) if _super_call(s, "__init__") is not None), None)
    if index is None:
        raise AssembleError(f"{sub_init.name.value}: an __init__ that does not call super().__init__ is not merged")
    call = _super_call(body[index], "__init__")
    passed = [a.keyword.value if a.keyword else (a.value.value if isinstance(a.value, cst.Name) else None)
              for a in call.args]
    values = [a.value.value if isinstance(a.value, cst.Name) else None for a in call.args]
    if passed != values or passed != params[:len(passed)] or len(passed) != len(params):
        raise AssembleError(f"super().__init__({', '.join(map(str, values))}) does not pass the base's parameters "
                            f"({', '.join(params)}) by their own names: not merged")
    base_body = list(base_init.body.body)
    if base_body and _is_docstring(base_body[0]):
        base_body.pop(0)
    inlined = body[:index] + base_body + body[index + 1:]
    return sub_init.with_changes(body=sub_init.body.with_changes(body=([doc] if doc else []) + inlined))


def flatten(module: cst.Module) -> cst.Module:
    """Merge each class used only as the base of one other class into that class."""
    while True:
        classes = {s.name.value: s for s in module.body if isinstance(s, cst.ClassDef)}
        uses: dict[str, int] = {}
        for name in _names(module).names:
            uses[name] = uses.get(name, 0) + 1
        pair = None
        for sub in classes.values():
            bases = [b.value.value for b in sub.bases if isinstance(b.value, cst.Name)]
            for base in bases:
                if base in classes and uses.get(base, 0) == 1 and len(sub.bases) == 1:
                    pair = (classes[base], sub)
                    break
            if pair:
                break
        if pair is None:
            return module
        base, sub = pair
        merged = _merge(base, sub)
        body = []
        for stmt in module.body:
            if stmt is base:
                continue
            body.append(merged.with_changes(leading_lines=stmt.leading_lines) if stmt is sub else stmt)
        module = module.with_changes(body=body)


# ---- dropping what nothing uses ----------------------------------------------------------------------
class _DropMethods(cst.CSTTransformer):
    def __init__(self, referenced: set[str]):
        self.referenced = referenced
        self.dropped = 0

    def leave_ClassDef(self, original, updated):
        body = []
        for member in updated.body.body:
            name = member.name.value if isinstance(member, cst.FunctionDef) else None
            if name and name.startswith("_") and not name.startswith("__") and name not in self.referenced:
                self.dropped += 1
                continue
            body.append(member)
        return updated.with_changes(body=updated.body.with_changes(body=body))


def prune(module: cst.Module, keep: set[str]) -> cst.Module:
    """Module-level definitions not reachable from `keep`, and private methods no attribute names, dropped."""
    while True:
        definitions = {}
        for stmt in module.body:
            for name in _defined(stmt):
                definitions.setdefault(name, []).append(stmt)
        live, work = set(), [n for n in keep if n in definitions]
        for stmt in module.body:        # statements that define nothing (a call at module level) keep what they use
            if not _defined(stmt):
                work += [n for n in _names(stmt).names if n in definitions]
        while work:
            name = work.pop()
            if name in live:
                continue
            live.add(name)
            for stmt in definitions[name]:
                work += [n for n in _names(stmt).names if n in definitions and n not in live]
        body = [s for s in module.body if not _defined(s) or any(n in live for n in _defined(s))]
        referenced = _names(module.with_changes(body=body)).attrs
        dropper = _DropMethods(referenced)
        pruned = module.with_changes(body=body).visit(dropper)
        if len(body) == len(module.body) and not dropper.dropped:
            return pruned
        module = pruned


# ---- imports ------------------------------------------------------------------------------------------
class _Imports:
    """The absolute imports of the code files, merged: `import a.b as c` and `from a import b [as c]`."""

    def __init__(self):
        self.plain: dict[str, str | None] = {}          # "torch.distributed" -> "dist"
        self.names: dict[str, dict[str, str | None]] = {}   # "module.linear" -> {"QKVParallelLinear": None}

    def add(self, node) -> None:
        if isinstance(node, cst.Import):
            for alias in node.names:
                self.plain[_dotted(alias.name)] = alias.asname.name.value if alias.asname else None
        else:
            module = _dotted(node.module)
            for alias in node.names:
                self.names.setdefault(module, {})[alias.name.value] = alias.asname.name.value if alias.asname else None

    def text(self, used: set[str]) -> str:
        groups: dict[int, list[str]] = {0: [], 1: [], 2: []}

        def group(module: str) -> int:
            top = module.split(".")[0]
            return 0 if top in sys.stdlib_module_names else 2 if top in LOCAL_PACKAGES else 1

        for module in sorted(self.plain):
            local = self.plain[module] or module.split(".")[0]
            if local in used:
                groups[group(module)].append(f"import {module}" + (f" as {self.plain[module]}" if self.plain[module] else ""))
        froms: dict[int, list[str]] = {0: [], 1: [], 2: []}
        for module in sorted(self.names):
            names = [(n, a) for n, a in sorted(self.names[module].items()) if (a or n) in used]
            if not names:
                continue
            written = [f"{n} as {a}" if a else n for n, a in names]
            line = f"from {module} import {', '.join(written)}"
            if len(line) > 100:
                line = f"from {module} import (\n" + "".join(f"    {w},\n" for w in written) + ")"
            froms[group(module)].append(line)
        blocks = ["\n".join(groups[g] + froms[g]) for g in (0, 1, 2) if groups[g] or froms[g]]
        return "\n\n".join(blocks)


# ---- the file ----------------------------------------------------------------------------------------
def _strip_blank(stmt):
    lines = list(stmt.leading_lines)
    while lines and lines[0].comment is None:
        lines.pop(0)
    return stmt.with_changes(leading_lines=lines)


def _option_statement(stmt, option_names) -> str | None:
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(stmt.body[0], cst.Assign):
        targets = stmt.body[0].targets
        if len(targets) == 1 and isinstance(targets[0].target, cst.Name) and targets[0].target.value in option_names:
            return targets[0].target.value
    return None


def _option_value(path: Path, option: str, options: dict, option_names, stmt=None):
    """The composition's value of `option`, else its default where the code file `path` declares it (`stmt`)."""
    value = options.get(option, _UNKNOWN)
    if value is not _UNKNOWN:
        return value
    if stmt is None:
        stmt = next((s for s in _parse_path(path).body if _option_statement(s, option_names) == option), None)
        if stmt is None:
            raise AssembleError(f"{path.name} declares no option {option}, which a sibling imports from it")
    value = _const(stmt.body[0].value)
    if value is _UNKNOWN:
        raise AssembleError(f"{path.name}: option {option}'s default is not a literal")
    return value


def _table(name: str, value: tuple, comments: list[str]) -> str:
    lines = "".join(f"    {source(item)},\n" for item in value)
    return "".join(f"{c}\n" for c in comments) + f"{name} = (\n{lines})"


def assemble(files: list[str], *, options: dict, option_names: set[str], roles: dict[str, str], prefix: str,
             framework_class: str, header: str = "", docstring: str = "", code_dir: Path = CODE_DIR,
             tables: frozenset = frozenset(), keep: tuple[str, ...] = (f"{PLACEHOLDER}ForCausalLM",)) -> str:
    """The one file of `files` (code files under CODE_DIR, with the siblings they import) for `options`
    (option name -> value; an option not given keeps its code file's default), `roles` (role -> the class that
    fills it), the family's class `prefix` and its ForCausalLM class name."""
    for name in (prefix, framework_class):
        if not (name.isidentifier() and name[:1].isupper()):
            raise AssembleError(f"class name {name!r} is not a capitalised Python identifier")
    imports = _Imports()
    table_text: dict[str, str] = {}
    statements = []
    for name in file_order(files, code_dir):
        module = _parse_path(code_dir / name)
        body = list(module.body)
        if body and _is_docstring(body[0]):
            body.pop(0)
        values, kept = {}, []
        # an option a sibling declares and this file imports (`from .layer_mlp import NORM_EPS`): its one value
        for dep, imported, local in _relative_imports(module):
            if imported in option_names and imported not in tables:
                values[local] = literal(_option_value(code_dir / dep, imported, options, option_names))
        for stmt in body:
            option = _option_statement(stmt, option_names)
            if option is not None:
                value = _option_value(code_dir / name, option, options, option_names, stmt)
                if isinstance(value, tuple) and value and option in tables:
                    comments = [line.comment.value for line in stmt.leading_lines if line.comment is not None]
                    table = _table(option, value, comments)
                    if table_text.setdefault(option, table) != table:
                        raise AssembleError(f"option {option} has two values: {table_text[option]} / {table}")
                else:
                    values[option] = literal(value)
                continue
            if isinstance(stmt, cst.SimpleStatementLine) and all(isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body):
                for small in stmt.body:
                    if not (isinstance(small, cst.ImportFrom) and small.relative):
                        imports.add(small)
                continue
            kept.append(stmt)
        piece = cst.Module(body=kept).visit(_Rename(values))
        statements += list(piece.body)
    module = cst.Module(body=statements)
    module = module.visit(_Rename({role: cst.Name(cls) for role, cls in roles.items()}))
    keep = set(keep)
    previous = None
    while previous is None or not module.deep_equals(previous):
        previous = module
        module = prune(flatten(fold(propagate(module))), keep)
    seen = _names(module)
    unbound = sorted({n for n in seen.names if n in ROLES})
    if unbound:
        raise AssembleError(f"the composition fills no part for {', '.join(unbound)}, which the code still uses")
    # module-level constants first (after the imports), then the definitions
    constants, definitions = [], []
    names_seen: dict[str, str] = {}
    for stmt in module.body:
        code = cst.Module(body=[_strip_blank(stmt)]).code.rstrip("\n")
        if isinstance(stmt, cst.SimpleStatementLine):
            defined = tuple(_defined(stmt))
            if defined and names_seen.get(defined) not in (None, code):
                raise AssembleError(f"{', '.join(defined)} defined twice, differently")
            if defined in names_seen:
                continue
            names_seen[defined] = code
            constants.append(code)
        else:
            definitions.append(code)
    used = set(_names(module).names) | {n for t in table_text.values() for n in re.findall(r"[A-Za-z_]\w*", t)}
    table_text = {k: v for k, v in table_text.items() if k in used}
    top = "\n\n".join(p for p in (header.strip("\n"), f'"""{docstring}"""' if docstring else "") if p)
    body = [imports.text(used), "\n".join([*table_text.values(), *constants]), *definitions]
    text = (top + "\n\n" if top else "") + "\n\n\n".join(p.strip("\n") for p in body if p.strip())
    placeholders = sorted({n for n in re.findall(rf"\b{PLACEHOLDER}[A-Z]\w*", text)
                           if n in {d for s in module.body for d in _defined(s)}}, key=len, reverse=True)
    for name in placeholders:
        new = framework_class if name == f"{PLACEHOLDER}ForCausalLM" else prefix + name[len(PLACEHOLDER):]
        text = re.sub(rf"\b{name}\b", new, text)
    text = text.rstrip("\n") + "\n"
    compile(text, f"modeling_{prefix}.py", "exec", dont_inherit=True)
    return text


# ---- the native model's file --------------------------------------------------------------------------------
def class_prefix(framework_class: str) -> str:
    return framework_class.removesuffix("ForCausalLM") or framework_class


def native_header(ctx: dict) -> str:
    """The licence header: the file is adapted from the transformers code it was derived from."""
    from agent import provenance

    what = (f"{ctx['model_name']}: {ctx.get('architecture') or ctx['model_name']} for cann-recipes-infer's executor, "
            "written by infer-migrator's native generator from the transformers code below")
    if not ctx.get("modeling_module"):
        return f"# coding=utf-8\n# {what}\n"
    prov = provenance.of_vendored_model(str(ctx["modeling_module"]), ctx.get("transformers_version"),
                                        ctx.get("model_source"), ctx.get("model_path"))
    return provenance.header_text(prov, what)


def _items(lines: list[str], width: int = 116, indent: str = "  ") -> str:
    import textwrap

    return "".join(textwrap.fill(line, width=width, subsequent_indent=indent, break_on_hyphens=False) + "\n"
                   for line in lines)


def module_docstring(composition, ctx: dict) -> str:
    from agent.recipe.templating import _docstring

    display = _docstring(ctx.get("display_name") or ctx["model_name"])
    model_class = _docstring(ctx.get("model_class") or ctx["framework_class"])
    intro = (f"{display} for Ascend NPU inference on cann-recipes-infer's executor, in upstream's shape "
             "(models/qwen/models/modeling_qwen.py): plain nn.Modules taking (config, infer_config, comm_manager, "
             "prefix), the paged KV cache declared by each attention's `cache_entries`, tensor parallel by "
             "module.linear's layers over attn_tp_group and lmhead_tp_group. What a checkpoint's config sets (its "
             "rope type, biases, tied embeddings, sliding windows, MoE layout) is read from it when the model is "
             "built: the file serves the family's checkpoints.")
    parts = [f"* {slot}: {match.name}" for slot, match in composition.listed()]
    kernels = [f"* {_docstring(item)}" for item in composition.fused]
    kernels += [f"* not fused: {_docstring(item)}" for item in composition.unfused]
    return (_items([intro], indent="") + "\nParts (infer-migrator's native generator, agent/recipe/native/parts):\n" + _items(parts)
            + f"\nKernels, as the architecture's arithmetic allows them (the generator held this file to transformers' "
            f"{model_class} before writing it):\n" + _items(kernels))


def write(composition, ctx: dict) -> str:
    """The native modeling file of `composition` for the render context `ctx` (model_name, framework_class,
    display_name, model_class; the provenance keys of native_header)."""
    framework_class = ctx["framework_class"]
    return assemble(composition.files, options=composition.options, option_names=composition.option_names(),
                    tables=composition.tables(),
                    roles=composition.roles, prefix=class_prefix(framework_class), framework_class=framework_class,
                    header=native_header(ctx), docstring=module_docstring(composition, ctx),
                    keep=(f"{PLACEHOLDER}ForCausalLM", *composition.kept))
