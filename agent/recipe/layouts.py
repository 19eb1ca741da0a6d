"""Whether a framework recipe's own model code runs at a parallel layout, read from the code (no run).

Upstream's models register the communication groups they need under conditions on the layout and
use them on code paths chosen by the layout: models/qwen3_moe registers `moe_ep_group` only
`if self.moe_ep_size > 1`, and takes its expert-parallel path (which gets that group) whenever
`moe_tp_size` is 1 — so at one rank (moe_tp 1, moe_ep = world_size // moe_tp = 1) its code asks for
a group it never registered ("KeyError: Communication group 'moe_ep_group' not found"). Its YAMLs never
ask for that layout (128ep, 16tp, 1tp_16ep, attn4tp8dp, ...: expert or tensor parallel over more than
one rank); a run scaled down to fewer ranks can.

`problems(code, layout)` walks each class of the recipe's models/*.py from the methods no other method
of it calls (forward, __init__, load_weights, ...) through `self.method(...)` calls, following the
branches the layout takes (`if self.moe_tp_size > 1:` / its else, an early return, `a if cond else b`;
attributes resolved through `self.x = ...parallel_config.y`; both branches of a condition on the step's
phase, is_prefill, since a run has both), and names each group that code certainly gets (`get_group` /
`get_rank` / `get_group_name` / `get_world_size`) while every place that registers it
(`register_group(name=...)`) is on a branch the layout does not take. A condition on anything else (a
quantization mode, a flag) may go either way: what lies behind it is neither certainly used nor
certainly unregistered, so the check names only what the layout certainly breaks.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

GROUP_USES = frozenset({"get_group", "get_rank", "get_group_name", "get_world_size"})
MAX_FILE_BYTES = 4 << 20


@dataclass(frozen=True)
class Site:
    file: str           # recipe-relative path
    line: int
    guards: tuple       # ((test expression, polarity), ...) from the function's entry to the site
    aliases: tuple      # the class's and function's names of parallel_config settings


@dataclass
class Method:
    calls: list = field(default_factory=list)           # (callee method name, Site)
    registers: list = field(default_factory=list)       # (group name, Site)
    uses: list = field(default_factory=list)            # (group name, Site)


@dataclass
class CodeFacts:
    classes: dict                                       # "file:Class" -> {method name: Method}

    @classmethod
    def of(cls, recipe_dir: Path) -> CodeFacts:
        classes = {}
        models = Path(recipe_dir) / "models"
        for path in sorted(models.glob("*.py")) if models.is_dir() else []:
            if not path.is_file() or path.is_symlink() or path.stat().st_size > MAX_FILE_BYTES:
                continue
            try:
                tree = ast.parse(path.read_text(errors="replace"))
            except (SyntaxError, ValueError):
                continue
            rel = path.relative_to(recipe_dir).as_posix()
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    classes[f"{rel}:{node.name}"] = _read_class(node, rel)
        return cls(classes)


# ---- reading the code -------------------------------------------------------------------------
def _setting_of(value: ast.AST, known: dict) -> str | None:
    """The parallel_config setting an expression reads (`...parallel_config.moe_ep_size`, `self.x` already
    known as one, `x // y` is not one), else None."""
    if isinstance(value, ast.Attribute):
        if isinstance(value.value, ast.Attribute) and value.value.attr == "parallel_config":
            return value.attr
        if isinstance(value.value, ast.Name) and value.value.id == "self":
            return known.get(f"self.{value.attr}")
    if isinstance(value, ast.Name):
        return known.get(value.id)
    return None


def _class_aliases(node: ast.ClassDef) -> dict:
    known: dict = {}
    for _ in range(3):                 # `self.ep_size = self.moe_ep_size` after `self.moe_ep_size = ...`
        for item in ast.walk(node):
            if isinstance(item, ast.Assign) and len(item.targets) == 1:
                target = item.targets[0]
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    setting = _setting_of(item.value, known)
                    if setting:
                        known.setdefault(f"self.{target.attr}", setting)
    return known


def _read_class(node: ast.ClassDef, rel: str) -> dict:
    aliases = _class_aliases(node)
    methods = {}
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local = dict(aliases)
            for sub in ast.walk(item):
                if isinstance(sub, ast.Assign) and len(sub.targets) == 1 and isinstance(sub.targets[0], ast.Name):
                    setting = _setting_of(sub.value, local)
                    if setting:
                        local.setdefault(sub.targets[0].id, setting)
            method = Method()
            _walk_block(item.body, (), method, rel, tuple(sorted(local.items())))
            methods[item.name] = method
    return methods


def _ends(block: list) -> bool:
    return bool(block) and isinstance(block[-1], (ast.Return, ast.Raise))


def _walk_block(body: list, guards: tuple, method: Method, rel: str, aliases: tuple) -> None:
    for stmt in body:
        if isinstance(stmt, ast.If):
            _walk_expr(stmt.test, guards, method, rel, aliases)
            _walk_block(stmt.body, guards + ((stmt.test, True),), method, rel, aliases)
            _walk_block(stmt.orelse, guards + ((stmt.test, False),), method, rel, aliases)
            if _ends(stmt.body) and not stmt.orelse:
                guards = guards + ((stmt.test, False),)          # an early return: the rest runs only otherwise
            continue
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        blocks = [getattr(stmt, name) for name in ("body", "orelse", "finalbody", "handlers")
                  if isinstance(getattr(stmt, name, None), list)]
        for child in ast.iter_child_nodes(stmt):
            if isinstance(child, ast.expr):
                _walk_expr(child, guards, method, rel, aliases)
            elif isinstance(child, ast.withitem):
                _walk_expr(child.context_expr, guards, method, rel, aliases)
        for block in blocks:
            inner = [b for h in block for b in (h.body if isinstance(h, ast.ExceptHandler) else [h])]
            _walk_block(inner, guards, method, rel, aliases)


def _walk_expr(expr: ast.AST, guards: tuple, method: Method, rel: str, aliases: tuple) -> None:
    if isinstance(expr, ast.IfExp):
        _walk_expr(expr.test, guards, method, rel, aliases)
        _walk_expr(expr.body, guards + ((expr.test, True),), method, rel, aliases)
        _walk_expr(expr.orelse, guards + ((expr.test, False),), method, rel, aliases)
        return
    if isinstance(expr, (ast.Lambda,)):
        return
    if isinstance(expr, ast.Call):
        _record_call(expr, Site(rel, expr.lineno, guards, aliases), method)
    for child in ast.iter_child_nodes(expr):
        _walk_expr(child, guards, method, rel, aliases)


def _constant_name(call: ast.Call) -> str | None:
    for keyword in call.keywords:
        if keyword.arg in ("name", "group_name") and isinstance(keyword.value, ast.Constant):
            return keyword.value.value if isinstance(keyword.value.value, str) else None
    if call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    return None


def _record_call(call: ast.Call, site: Site, method: Method) -> None:
    func = call.func
    if not isinstance(func, ast.Attribute):
        return
    if isinstance(func.value, ast.Name) and func.value.id == "self":
        method.calls.append((func.attr, site))
    elif func.attr == "register_group":
        name = _constant_name(call)
        if name:
            method.registers.append((name, site))
    elif func.attr in GROUP_USES:
        name = _constant_name(call)
        if name:
            method.uses.append((name, site))


# ---- evaluating it at a layout -------------------------------------------------------------
def layout_values(parallel: dict) -> dict:
    """A parallel_config's settings as upstream's InferenceConfig derives them
    (executor/core/config/inference_config.py: moe_ep_size = world_size // moe_tp_size, attn_dp_size =
    world_size // attn_tp_size)."""
    values = {k: v for k, v in parallel.items() if isinstance(v, int) and not isinstance(v, bool)}
    world = values.get("world_size", 1) or 1
    values.setdefault("moe_tp_size", 1)
    values.setdefault("attn_tp_size", 1)
    values["moe_ep_size"] = world // max(values["moe_tp_size"], 1)
    values["attn_dp_size"] = world // max(values["attn_tp_size"], 1)
    return values


def _value(node: ast.AST, aliases: dict, values: dict):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, bool)):
        return node.value
    key = f"self.{node.attr}" if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
        and node.value.id == "self" else node.id if isinstance(node, ast.Name) else None
    setting = aliases.get(key) if key else None
    if setting is None and isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
            and node.value.attr == "parallel_config":
        setting = node.attr
    return values.get(setting) if setting else None


_COMPARE = {ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b, ast.Lt: lambda a, b: a < b,
            ast.LtE: lambda a, b: a <= b, ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b}
BOTH = "both"           # a condition on the step's phase: a run has a prefill and decode steps, both branches run
_PHASE = re.compile(r"prefill|decode", re.I)


def evaluate(test: ast.AST, aliases: dict, values: dict):
    """True / False at the layout; BOTH for a condition on the step's phase (is_prefill); None where the
    condition reads anything else (a quantization mode, a flag of the checkpoint)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = evaluate(test.operand, aliases, values)
        return inner if inner in (None, BOTH) else not inner
    if isinstance(test, ast.BoolOp):
        results = [evaluate(v, aliases, values) for v in test.values]
        decisive, neutral = (False, True) if isinstance(test.op, ast.And) else (True, False)
        if decisive in results:
            return decisive
        if None in results:
            return None
        return neutral if all(r is neutral for r in results) else BOTH
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in _COMPARE:
        left, right = _value(test.left, aliases, values), _value(test.comparators[0], aliases, values)
        if isinstance(left, int) and isinstance(right, int):
            return _COMPARE[type(test.ops[0])](left, right)
    if isinstance(test, (ast.Name, ast.Attribute)) and _PHASE.search(ast.unparse(test)):
        return BOTH
    return None


def _reached(site: Site, values: dict, certainly: bool) -> bool:
    """Every condition on the way to the site holds (`certainly`), or none is false at the layout."""
    aliases = dict(site.aliases)
    for test, polarity in site.guards:
        result = evaluate(test, aliases, values)
        if result is (not polarity) or (certainly and result is None):
            return False
    return True


def _condition(site: Site) -> str:
    return " and ".join(("" if polarity else "not ") + ast.unparse(test) for test, polarity in site.guards) or "always"


def _live_methods(methods: dict, values: dict, certainly: bool) -> set:
    """The methods a layout runs: those no other method of the class calls (forward, __init__, load_weights,
    ...: the executor's), then every `self.method(...)` reached from them."""
    called = {name for method in methods.values() for name, _ in method.calls if name in methods}
    live = {name for name in methods if name not in called} | ({"__init__", "forward"} & set(methods))
    grew = True
    while grew:
        grew = False
        for name in list(live):
            for callee, site in methods[name].calls:
                if callee in methods and callee not in live and _reached(site, values, certainly):
                    live.add(callee)
                    grew = True
    return live


def problems(code: CodeFacts, parallel: dict) -> list[str]:
    """One line per communication group the recipe's code certainly gets at `parallel` (a parallel_config)
    and registers only under conditions false there (its first use)."""
    values = layout_values(parallel)
    registered, conditional, uses = set(), {}, []
    for methods in code.classes.values():
        possible, certain = _live_methods(methods, values, False), _live_methods(methods, values, True)
        for name, method in methods.items():
            for group, site in method.registers:
                conditional.setdefault(group, site)
                if name in possible and _reached(site, values, certainly=False):
                    registered.add(group)
            if name in certain:
                uses += [(group, site) for group, site in method.uses if _reached(site, values, certainly=True)]
    found = {}
    for group, site in uses:                   # the first use of each group
        if group in conditional and group not in registered and group not in found:
            where = conditional[group]
            found[group] = (f"its code gets the communication group {group!r} ({site.file}:{site.line}) that it "
                            f"registers only where `{_condition(where)}` ({where.file}:{where.line})")
    return list(found.values())


def describe(parallel: dict) -> str:
    """`2 ranks (attn_tp 2, moe_tp 2, so moe_ep 1)`: the settings that pick upstream's code paths."""
    values = layout_values(parallel)
    world = values.get("world_size", 1)
    shown = [f"{key.removesuffix('_size')} {values[key]}" for key in ("attn_tp_size", "moe_tp_size")]
    return f"{world} rank{'s' if world != 1 else ''} ({', '.join(shown)}, so moe_ep {values['moe_ep_size']})"
