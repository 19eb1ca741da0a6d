"""Static scan: which torch_npu / torch.npu / torch.ops.npu / torchair names a source tree uses.

`SourceScan` is the one `ast` walker every NPU scan of this project is written on: it parses a source
(one that does not parse scans to nothing), follows the scopes that make an import lazy (a function),
optional (the body of a try, or of an if) or not certain to run (any of those, or a with), and reads
dotted attribute chains. The rule sets on it: this module's (every NPU name, for the stand-in's
coverage), agent.recipe.npu_scan's (NPU kernels with no portable path) and agent.recipe.compiled_ops's
(compiled custom operators).

Reads Python files with `ast` (never imports them). Names are written the way the stand-in
resolves them: ``torch_npu.npu_rms_norm``, ``torch.npu.synchronize``,
``torch.ops.npu.npu_fused_infer_attention_score_v2``, ``torchair.scope.npu_stream_switch``,
``Tensor.npu`` (any ``x.npu(...)`` call). Aliases are followed (``import torchair as tng``,
``from torch_npu import npu_swiglu``, ``import torch_npu.profiler``); a chain stops at a call
(``torch.npu.current_stream().wait_stream`` counts ``torch.npu.current_stream``).

`coverage()` says, for each name, what the stand-in does with it (a reference kernel, a runtime
stand-in, or nothing), by resolving it on the activated stand-in in this process.
"""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOTS = ("torch_npu", "torchair")
SKIP_DIRS = {".git", "__pycache__", ".venv", "venv", "site-packages", "res"}


@dataclass
class Use:
    name: str
    file: str
    line: int


@dataclass
class ScanResult:
    uses: list[Use] = field(default_factory=list)
    files: int = 0

    def counts(self) -> Counter:
        return Counter(u.name for u in self.uses)

    def kernels(self) -> Counter:
        """Counts of the kernel names only (torch_npu.npu_*, torch_npu._npu_*, torch.ops.npu.*,
        torchair.ops.*), merged under the op's own name (npu_rms_norm)."""
        merged: Counter = Counter()
        for use in self.uses:
            op = kernel_name(use.name)
            if op:
                merged[op] += 1
        return merged

    def first_use(self, name: str) -> Use | None:
        return next((u for u in self.uses if u.name == name), None)


def kernel_name(name: str) -> str | None:
    """The op a dotted name calls, or None when it is not a kernel."""
    parts = name.split(".")
    if parts[0] == "torch_npu" and len(parts) == 2 and parts[1].startswith(("npu_", "_npu_", "scatter_update")):
        return parts[1]
    if parts[:3] == ["torch", "ops", "npu"] and len(parts) >= 4:
        return parts[3]
    if parts[:2] == ["torchair", "ops"] and len(parts) >= 3 and parts[2].startswith("npu_"):
        return parts[2]
    return None


def chain(node: ast.AST) -> tuple[str, list[str]] | None:
    """`a.b.c` as ("a", ["b", "c"]); None when the chain does not start at a name (a call, a subscript)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return node.id, list(reversed(parts))


def dotted(node: ast.AST) -> str | None:
    found = chain(node)
    return ".".join([found[0], *found[1]]) if found else None


class SourceScan(ast.NodeVisitor):
    """The walker the rule sets subclass: `found` is what they record; the counters say where the
    node being visited is: `functions` (inside a function: a lazy import), `guards` (in the body of a
    try, or of an if: an optional import) and `blocks` (inside a function, try, if or with: not certain
    to run)."""

    def __init__(self):
        self.found: list = []
        self.functions = 0
        self.guards = 0
        self.blocks = 0

    @classmethod
    def scan(cls, source: str, *args, **kwargs):
        """The visitor after a walk of `source`; None when it does not parse."""
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            return None
        visitor = cls(*args, **kwargs)
        visitor.visit(tree)
        return visitor

    def visit_Try(self, node):
        self.blocks += 1
        self.guards += 1
        for stmt in node.body:
            self.visit(stmt)
        self.guards -= 1
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)
        self.blocks -= 1

    visit_TryStar = visit_Try

    def visit_If(self, node):
        self.blocks += 1
        self.visit(node.test)
        self.guards += 1
        for stmt in (*node.body, *node.orelse):
            self.visit(stmt)
        self.guards -= 1
        self.blocks -= 1

    def visit_With(self, node):
        self.blocks += 1
        self.generic_visit(node)
        self.blocks -= 1

    def _visit_function(self, node):
        self.functions += 1
        self.blocks += 1
        self.generic_visit(node)
        self.blocks -= 1
        self.functions -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_function


class _Visitor(SourceScan):
    def __init__(self):
        super().__init__()
        self.aliases: dict[str, str] = {"torch": "torch"}     # local name -> dotted module/attr

    # imports bind names to dotted paths
    def visit_Import(self, node):
        for alias in node.names:
            top = alias.name.split(".")[0]
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                self.aliases[top] = top
            if top in ROOTS:
                self.found.append((alias.name, node.lineno))

    def visit_ImportFrom(self, node):
        module = node.module or ""
        if node.level or module.split(".")[0] not in ROOTS + ("torch",):
            return
        for alias in node.names:
            full = f"{module}.{alias.name}"
            if module.split(".")[0] == "torch" and not full.startswith(("torch.npu", "torch.ops.npu")):
                continue
            self.aliases[alias.asname or alias.name] = full
            self.found.append((full, node.lineno))

    def visit_Attribute(self, node):
        found = chain(node)
        if found is not None:
            head, rest = found
            base = self.aliases.get(head)
            if base is not None:
                full = ".".join([base, *rest])
                if _interesting(full):
                    self.found.append((full, node.lineno))
                    return
        self.generic_visit(node)

    def visit_Name(self, node):
        base = self.aliases.get(node.id)
        if base and base != node.id and _interesting(base) and isinstance(node.ctx, ast.Load):
            self.found.append((base, node.lineno))

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "npu" and not _is_module_chain(func.value, self.aliases):
            self.found.append(("Tensor.npu", node.lineno))
        self.generic_visit(node)


def _interesting(full: str) -> bool:
    return full.split(".")[0] in ROOTS or full.startswith(("torch.npu.", "torch.ops.npu.")) or full == "torch.npu"


def _is_module_chain(node, aliases) -> bool:
    found = chain(node) if isinstance(node, (ast.Attribute, ast.Name)) else None
    return found is not None and found[0] in aliases and aliases[found[0]].split(".")[0] in ROOTS + ("torch",)


def scan_source(source: str) -> list[tuple[str, int]]:
    visitor = _Visitor.scan(source)
    return visitor.found if visitor is not None else []


def scan_tree(root: str | Path) -> ScanResult:
    root = Path(root)
    result = ScanResult()
    paths = [root] if root.is_file() else sorted(root.rglob("*.py"))
    for path in paths:
        rel = path.relative_to(root) if path != root else Path(path.name)
        if set(rel.parts[:-1]) & SKIP_DIRS:
            continue
        try:
            source = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        result.files += 1
        result.uses += [Use(name, rel.as_posix(), line) for name, line in scan_source(source)]
    return result


# ---- coverage against the activated stand-in -----------------------------------------------
def coverage(names) -> dict[str, str]:
    """name -> "kernel" (a reference kernel), "runtime" (a stand-in object), or "missing".

    Must run in a process where the stand-in is active (npu_standin.activate)."""
    from npu_standin import kernels

    out = {}
    for name in names:
        op = kernel_name(name)
        if op is not None and kernels.has_reference(op):
            out[name] = "kernel"
            continue
        out[name] = "runtime" if _resolves(name) else "missing"
    return out


def _resolves(name: str) -> bool:
    import importlib

    if name == "Tensor.npu":
        import torch
        return hasattr(torch.Tensor, "npu")
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:  # noqa: BLE001 - not a module at this depth
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except Exception:  # noqa: BLE001 - an unsupported attribute raises its own one-line error
            return False
        from npu_standin.errors import is_unsupported
        return not is_unsupported(obj)
    return False
