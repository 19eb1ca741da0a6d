"""Static scan: does a recipe need an Ascend NPU, whatever repair we could do?

A recipe *needs* an NPU when it calls NPU kernels that have no portable equivalent:

- ``torch_npu.npu_*`` (``torch_npu.npu_rms_norm(...)``, ``from torch_npu import npu_rotary_mul``) and
  the private ``torch_npu._npu_*`` kernels (``torch_npu._npu_rotary_embedding``),
- ``torch.ops.npu.*``,
- torchair-only paths (``import torchair`` at module level whose names the module uses, or a lazy
  one when the recipe's YAML selects a graph ``exe_mode``; a bare unused import in the recipe's own
  code is guarded by a repair instead),
- an unguarded module-level ``import torch_npu`` in shared code the recipe imports but does not
  own (e.g. the repository's ``executor/``): nothing in the recipe can make that import portable.

Incidental NPU calls that have a portable equivalent (``torch.npu.synchronize()``, ``.npu()``,
``torch_npu.npu.set_device``, a guarded or recipe-owned ``import torch_npu``) are not kernels:
another part of the migrator makes them portable. The scan reads files with ``ast``; it never
imports or edits anything.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from agent.recipe.fs_guard import read_bytes, source_files
from agent.recipe.recipe import NO_CODE_DIRS
from engine.safe_load import loads_yaml
from npu_standin.scan import SourceScan, dotted

SKIP_DIRS = NO_CODE_DIRS
GRAPH_MODES_RE = re.compile(r"graph", re.I)
# torch_npu attributes that are kernels: npu_* and the private _npu_* (vllm-ascend#218), as
# agent.repair.rules.code.NPU_KERNEL_RE names them.
KERNEL_PREFIXES = ("npu_", "_npu_")


@dataclass(frozen=True)
class Kernel:
    name: str        # e.g. "npu_rms_norm", "torch.ops.npu.npu_add_rms_norm", "torchair", "import torch_npu"
    file: str        # path shown to the user (relative to the recipe, or to the repository for shared code)
    line: int
    shared: bool = False
    kind: str = "call"   # "call": a kernel used at this line; "import": an import line that needs the NPU

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class NpuScan:
    kernels: list[Kernel] = field(default_factory=list)
    files: int = 0

    @property
    def needs_npu(self) -> bool:
        return bool(self.kernels)

    def message(self) -> str:
        """Distinct kernels, how many places call them and the first call (an import line only when
        nothing is called: e.g. a module-level torchair import)."""
        calls = [k for k in self.kernels if k.kind == "call"]
        if not calls:
            names = list(dict.fromkeys(k.name for k in self.kernels))
            first = self.kernels[0]
            return (f"needs an Ascend NPU: NPU-only import{'s' if len(self.kernels) != 1 else ''} with no portable "
                    f"path ({', '.join(names)}; first: {first.name} at {first.where}); run on an NPU host")
        ops = list(dict.fromkeys(k.name for k in calls))
        shown = ", ".join(ops[:6]) + (", …" if len(ops) > 6 else "")
        return (f"needs an Ascend NPU: {len(ops)} torch_npu kernel{'s' if len(ops) != 1 else ''} ({shown}) "
                f"at {len(calls)} call site{'s' if len(calls) != 1 else ''}; first call: {calls[0].name} at "
                f"{calls[0].where}; run on an NPU host")


def npu_usable() -> bool:
    """True when engine.environment finds a usable NPU (torch_npu imports and sees a device)."""
    from engine.environment import DeviceUnavailableError, select_device

    try:
        select_device("npu")
    except DeviceUnavailableError:
        return False
    except Exception:
        return False
    return True


# ---- the rules, on the project's one AST walker (npu_standin.scan.SourceScan) ------------------
class _Visitor(SourceScan):
    def __init__(self, graph_mode: bool, shared: bool):
        super().__init__()
        self.graph_mode = graph_mode
        self.shared = shared
        self.found: list[tuple[str, int, str]] = []
        self.npu_aliases: set[str] = set()     # names bound to the torch_npu module
        self.kernel_aliases: dict[str, str] = {}   # names bound to a kernel (from torch_npu import npu_x as y)
        self.torchair_imports: list[tuple[int, set[str]]] = []
        self.loaded: set[str] = set()
        self.torch_aliases: set[str] = {"torch"}

    # imports (lazy inside a function, optional inside try/if)
    def visit_Import(self, node):
        for alias in node.names:
            top = alias.name.split(".")[0]
            bound = alias.asname or top
            if alias.name == "torch_npu" or (top == "torch_npu" and alias.asname is None):
                self.npu_aliases.add(bound)
                if self.shared and not self.guards and not self.functions:
                    self.found.append(("import torch_npu", node.lineno, "import"))
            elif top == "torch" and alias.asname is None:
                self.torch_aliases.add("torch")
            elif top == "torchair":
                self._torchair(node, [alias.asname or top])

    def visit_ImportFrom(self, node):
        module = node.module or ""
        top = module.split(".")[0]
        if top == "torch_npu":
            for alias in node.names:
                if module == "torch_npu" and alias.name.startswith(KERNEL_PREFIXES):
                    self.kernel_aliases[alias.asname or alias.name] = alias.name
                    self.found.append((alias.name, node.lineno, "import"))
        elif top == "torchair":
            self._torchair(node, [a.asname or a.name for a in node.names])

    def _torchair(self, node, names):
        lazy = self.functions or self.guards
        if not lazy or self.graph_mode:
            self.found.append(("torchair", node.lineno, "import"))
            self.torchair_imports.append((node.lineno, set(names)))

    def unused_torchair_lines(self) -> set[int]:
        """Lines of torchair imports whose names the module never reads: a bare import the recipe can
        guard (agent.repair.rules), not a torchair-only path."""
        return {line for line, names in self.torchair_imports if not names & self.loaded}

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load):
            self.loaded.add(node.id)
        if node.id in self.kernel_aliases and isinstance(node.ctx, ast.Load):
            self.found.append((self.kernel_aliases[node.id], node.lineno, "call"))

    # uses
    def visit_Attribute(self, node):
        name = dotted(node)
        if name:
            parts = name.split(".")
            if parts[0] in self.npu_aliases and len(parts) >= 2 and parts[1].startswith(KERNEL_PREFIXES):
                self.found.append((parts[1], node.lineno, "call"))
                return
            if parts[0] in self.torch_aliases and parts[1:3] == ["ops", "npu"] and len(parts) >= 4:
                self.found.append((f"torch.ops.npu.{parts[3]}", node.lineno, "call"))
                return
        self.generic_visit(node)


def scan_source_kinds(source: str, graph_mode: bool = False, shared: bool = False) -> list[tuple[str, int, str]]:
    """(kernel name, line, "call" | "import") in one Python source, in line order; [] when it does not parse."""
    visitor = _Visitor.scan(source, graph_mode, shared)
    if visitor is None:
        return []
    unused = set() if graph_mode or shared else visitor.unused_torchair_lines()
    found = [f for f in visitor.found if not (f[0] == "torchair" and f[1] in unused)]
    return sorted(dict.fromkeys(found), key=lambda item: item[1])


def scan_source(source: str, graph_mode: bool = False, shared: bool = False) -> list[tuple[str, int]]:
    """(kernel name, line) in one Python source, in line order; [] when it does not parse."""
    return list(dict.fromkeys((name, line) for name, line, _ in scan_source_kinds(source, graph_mode, shared)))


# ---- recipes ------------------------------------------------------------------------------
def _py_files(root: Path) -> list[Path]:
    """The recipe's Python files: regular files only (a FIFO or a link to a device named x.py is
    refused with one line, a folder named x.py is a folder), folder links never followed."""
    # a standalone recipe carries this project's engine (engine/), which picks its device backend at
    # run time (npu, cuda or cpu): its torch_npu calls are not the recipe's
    skip = SKIP_DIRS | ({"engine"} if (root / "engine" / "backends" / "npu.py").is_file() else set())
    return source_files(root, (".py",), skip)


def _read(path: Path) -> str:
    data = read_bytes(path)
    for encoding in ("utf-8-sig", "gb18030"):
        try:
            return data.decode(encoding)
        except UnicodeDecodeError:
            continue
    return data.decode("latin-1")


def _graph_mode(recipe_dir: Path) -> bool:
    """Any YAML of the recipe selects a graph exe_mode (ge_graph, npugraph_ex, ...)."""
    import yaml

    config = recipe_dir / "config"
    for path in source_files(config, (".yaml", ".yml")) if config.is_dir() else []:
        try:
            data = loads_yaml(_read(path)) or {}
        except Exception:
            continue
        if not isinstance(data, dict):
            continue
        model_config = data.get("model_config") if isinstance(data.get("model_config"), dict) else {}
        mode = model_config.get("exe_mode", data.get("exe_mode"))
        if isinstance(mode, str) and GRAPH_MODES_RE.search(mode):
            return True
    return False


def _imported_modules(source: str) -> set[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _module_file(repo_root: Path, dotted: str) -> Path | None:
    base = repo_root.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def shared_modules(recipe_dir: Path, repo_root: Path, sources: dict[Path, str]) -> list[Path]:
    """Repository files outside the recipe that the recipe imports, transitively (and their packages)."""
    recipe_dir = recipe_dir.resolve()
    repo_root = repo_root.resolve()
    seen: dict[Path, None] = {}
    queue = list(sources.values())
    while queue:
        source = queue.pop()
        for name in sorted(_imported_modules(source)):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                path = _module_file(repo_root, ".".join(parts[:i]))
                if path is None:
                    continue
                path = path.resolve()
                if path in seen or recipe_dir in path.parents or set(path.relative_to(repo_root).parts) & SKIP_DIRS:
                    continue
                seen[path] = None
                queue.append(_read(path))
    return sorted(seen)


def scan_recipe(recipe_dir: Path, repo_root: Path | None = None, entry_files: list[Path] | None = None) -> NpuScan:
    """Kernels in the recipe's own Python files, then in the shared repository code it imports.

    `entry_files`: shared files the entry point runs (e.g. executor/offline/infer.py for a
    framework recipe), scanned as shared code together with what they import.
    """
    recipe_dir = Path(recipe_dir).resolve()
    graph_mode = _graph_mode(recipe_dir)
    scan = NpuScan()
    own = {path: _read(path) for path in _py_files(recipe_dir)}
    for path, source in own.items():
        scan.files += 1
        rel = path.relative_to(recipe_dir).as_posix()
        scan.kernels += [Kernel(name, rel, line, kind=kind) for name, line, kind in scan_source_kinds(source, graph_mode)]
    if repo_root is not None:
        repo_root = Path(repo_root).resolve()
        roots = dict(own)
        for path in entry_files or []:
            if path.is_file():
                roots[path.resolve()] = _read(path)
        shared = shared_modules(recipe_dir, repo_root, roots)
        for path in sorted({*shared, *(p.resolve() for p in entry_files or [] if p.is_file())}):
            scan.files += 1
            rel = path.relative_to(repo_root).as_posix()
            scan.kernels += [Kernel(name, rel, line, shared=True, kind=kind)
                             for name, line, kind in scan_source_kinds(_read(path), graph_mode, shared=True)]
    return scan
