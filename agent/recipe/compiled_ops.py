"""Compiled custom operators a recipe calls, which no stand-in can run off an NPU.

cann-recipes-infer builds its own operators in `ops/`: AscendC kernels (the `custom_ops` package,
registered as `torch.ops.custom.*`), CANN ops-transformer kernels (`torch.ops.cann_ops_transformer.*`),
PyPTO kernels (`ops.pypto_python`, `torch.ops.custom_pypto.*`), TileLang kernels (`tilelang`, a
recipe's `tilelang_kernels/`) and the cannbot DSL (`ops.cannbot_dsl`). Under the npu stand-in these
are the one thing that needs an Ascend NPU (exit 4), named by distinct op and its first call site:

* `scan(recipe)` reads the recipe's Python files and the shared ones it imports (`ast`, nothing is
  imported or run): the ops imported at module level, unguarded, are certain to be reached;
* `from_evidence(text, roots)` reads a stand-in run's output: an op behind a YAML switch is reported
  when the run reached it (`No module named 'custom_ops'`, `'_OpNamespace' 'custom' object has no
  attribute 'X'`, ...), at the innermost frame inside the checkout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from agent.recipe.npu_scan import SKIP_DIRS, _read, shared_modules
from agent.recipe.recipe import Recipe
from npu_standin.scan import SourceScan, chain

# torch.ops namespace -> the kind of compiled op it holds
OP_NAMESPACES = {"custom": "AscendC", "custom_pypto": "PyPTO", "cann_ops_transformer": "CANN ops-transformer"}
# imported module (prefix) -> the kind
PACKAGES = {"custom_ops": "AscendC", "ops.ascendc": "AscendC", "ops.pypto_python": "PyPTO", "ops.pypto": "PyPTO",
            "pypto": "PyPTO", "tilelang": "TileLang", "tilelang_kernels": "TileLang", "ops.tilelang": "TileLang",
            "ops.cannbot_dsl": "cannbot DSL",
            # CANN ops-transformer's Python package (kimi_k3: `import cann_ops_transformer.ops`, its mega-MoE kernel)
            "cann_ops_transformer": "CANN ops-transformer"}


@dataclass(frozen=True)
class CompiledOp:
    name: str       # e.g. "torch.ops.custom.npu_hc_pre", "import custom_ops", "tilelang_kernels.sparse_attn_kernel"
    kind: str       # AscendC | PyPTO | TileLang | CANN ops-transformer | cannbot DSL
    where: str      # file:line

    def line(self) -> str:
        return f"{self.name} ({self.kind}) at {self.where}"


def _package_kind(module: str) -> str | None:
    for prefix, kind in PACKAGES.items():
        if module == prefix or module.startswith(prefix + "."):
            return kind
    return None


class _Visitor(SourceScan):
    """Compiled ops on the project's one AST walker (npu_standin.scan.SourceScan): an import outside
    every function, try, if and with is certain to run."""

    def visit_Import(self, node):
        for alias in node.names:
            if kind := _package_kind(alias.name):
                self.found.append((f"import {alias.name}", kind, node.lineno, self.blocks == 0))

    def visit_ImportFrom(self, node):
        module = node.module or ""
        if node.level == 0 and (kind := _package_kind(module)):
            self.found.append((f"from {module} import {', '.join(a.name for a in node.names)}", kind,
                               node.lineno, self.blocks == 0))

    def visit_Attribute(self, node):
        found = chain(node)
        if found is not None and found[0] == "torch":
            parts = found[1]
            if len(parts) >= 3 and parts[0] == "ops" and parts[1] in OP_NAMESPACES:
                self.found.append((f"torch.ops.{parts[1]}.{parts[2]}", OP_NAMESPACES[parts[1]], node.lineno,
                                   False))
                return
        self.generic_visit(node)


def scan_source(source: str) -> list[tuple[str, str, int, bool]]:
    visitor = _Visitor.scan(source)
    return visitor.found if visitor is not None else []


def scan(recipe: Recipe) -> tuple[list[CompiledOp], list[CompiledOp]]:
    """(certain, possible): compiled ops imported unguarded at module level by the recipe's modules
    or the shared code they import, and every other call site, one per distinct op, in file order."""
    own = {p: _read(p) for p in sorted(recipe.path.rglob("*.py"))
           if not set(p.relative_to(recipe.path).parts[:-1]) & SKIP_DIRS}
    files = dict(own)
    root = recipe.repo_root or recipe.path
    if recipe.repo_root is not None:
        roots = dict(own)
        for entry in recipe.entry_files:
            if entry.is_file():
                roots[entry.resolve()] = _read(entry)
        for path in shared_modules(recipe.path, recipe.repo_root, roots):
            files.setdefault(path, _read(path))
    certain: dict[str, CompiledOp] = {}
    possible: dict[str, CompiledOp] = {}
    for path, source in files.items():
        try:
            rel = path.resolve().relative_to(Path(root).resolve()).as_posix()
        except ValueError:
            rel = str(path)
        for name, kind, line, is_certain in scan_source(source):
            op = CompiledOp(name, kind, f"{rel}:{line}")
            (certain if is_certain else possible).setdefault(name, op)
    return list(certain.values()), [op for name, op in possible.items() if name not in certain]


def message(ops: list[CompiledOp]) -> str:
    kinds = sorted({op.kind for op in ops})
    more = f"; also: {', '.join(op.name for op in ops[1:5])}" if len(ops) > 1 else ""
    return (f"needs an Ascend NPU: compiled custom op{'s' if len(ops) > 1 else ''} ({', '.join(kinds)}) the npu "
            f"stand-in cannot run: {len(ops)} distinct (first: {ops[0].line()}){more}")


_EVIDENCE = [
    (re.compile(r"No module named '(?P<name>(?:custom_ops|cann_ops_transformer|tilelang|tilelang_kernels|pypto|ops\.(?:pypto_python|pypto|"
                r"ascendc|tilelang|cannbot_dsl))[\w.]*)'"), None),
    (re.compile(r"'_OpNamespace' '(?P<ns>custom|custom_pypto|cann_ops_transformer)' object has no attribute "
                r"'(?P<name>\w+)'"), "ns"),
    (re.compile(r"No such operator (?P<ns>custom|custom_pypto|cann_ops_transformer)::(?P<name>\w+)"), "ns"),
]
_FRAME_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def from_evidence(text: str, roots: list[Path]) -> CompiledOp | None:
    """The compiled op a failed run stopped at, with the innermost traceback frame inside `roots`."""
    for pattern, namespace in _EVIDENCE:
        found = pattern.search(text)
        if not found:
            continue
        if namespace:
            ns = found.group("ns")
            name, kind = f"torch.ops.{ns}.{found.group('name')}", OP_NAMESPACES[ns]
        else:
            name = found.group("name")
            name, kind = f"import {name}", _package_kind(name) or "compiled"
        where = "unknown location"
        for frame in _FRAME_RE.finditer(text[:found.start()]):
            path = Path(frame.group("file"))
            for root in roots:
                try:
                    where = f"{path.resolve().relative_to(Path(root).resolve()).as_posix()}:{frame.group('line')}"
                    break
                except (ValueError, OSError):
                    continue
        return CompiledOp(name, kind, where)
    return None
