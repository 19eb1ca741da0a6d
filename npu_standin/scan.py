"""Static scan: which torch_npu / torch.npu / torch.ops.npu / torchair names a source tree uses.

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


class _Visitor(ast.NodeVisitor):
    def __init__(self):
        self.found: list[tuple[str, int]] = []
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
        chain = _chain(node)
        if chain is not None:
            head, rest = chain
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
    chain = _chain(node) if isinstance(node, ast.Attribute) else ((node.id, []) if isinstance(node, ast.Name) else None)
    return chain is not None and chain[0] in aliases and aliases[chain[0]].split(".")[0] in ROOTS + ("torch",)


def _chain(node: ast.Attribute):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return node.id, list(reversed(parts))


def scan_source(source: str) -> list[tuple[str, int]]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    visitor = _Visitor()
    visitor.visit(tree)
    return visitor.found


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
