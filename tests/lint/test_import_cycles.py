"""No import cycle among agent/, engine/ and npu_standin/ modules, counting imports inside functions
too; none among their packages either (agent's sub-packages, agent's own modules, engine, npu_standin: a
cycle of packages is one no module cycle shows, e.g. recipe -> migrate -> codemods -> migrate -> recipe);
and the layers: what a lower layer imports never reaches up.

A function-level import that only dodges a cycle at load time is still a cycle in the design:
the two modules cannot be understood (or tested) apart.
"""

from __future__ import annotations

import ast
from pathlib import Path
from locations import REPO_ROOT
import subprocess
import sys

ROOT = REPO_ROOT
PACKAGES = ("agent", "engine", "npu_standin")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from agent.workflow import nodes` imports the module agent.workflow.nodes
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    graph = {name: imports_of(path, name, modules) for name, path in modules.items()}
    # A package's __init__ is imported with any of its submodules, but that is not a design edge.
    return {name: {t for t in targets if not name.startswith(t + ".")} for name, targets in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_agent_engine_and_the_standin_have_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def package_of(module: str) -> str:
    """The package a module belongs to: agent's sub-package (agent.recipe for agent.recipe.native.parts), an
    agent module of its own (agent.processes), or the top-level package (engine, npu_standin)."""
    parts = module.split(".")
    if parts[0] == "agent" and len(parts) > 1 and (ROOT / "agent" / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module if parts[0] == "agent" else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph folded onto packages (an import inside one package is no edge)."""
    folded: dict[str, set[str]] = {}
    for name, targets in graph.items():
        folded.setdefault(package_of(name), set()).update(
            package_of(t) for t in targets if package_of(t) != package_of(name))
    return folded


def edges_between(graph: dict[str, set[str]], packages: list[str]) -> list[str]:
    """The module imports that make a package cycle: every edge between two of `packages`."""
    return sorted(f"{name} -> {t}" for name, targets in graph.items() for t in targets
                  if package_of(name) in packages and package_of(t) in packages and package_of(name) != package_of(t))


def test_the_package_check_finds_a_cycle_no_module_cycle_shows():
    """A planted cycle: recipe.spec -> migrate.vendor -> codemods.x -> migrate.provenance, and recipe.targets
    -> migrate.provenance, migrate.vendor -> recipe.render: no module cycle, one cycle of three packages."""
    planted = {"agent.recipe.spec": {"agent.migrate.vendor"}, "agent.migrate.vendor": {"agent.codemods.x", "agent.recipe.render"},
               "agent.codemods.x": {"agent.migrate.provenance"}, "agent.migrate.provenance": set(),
               "agent.recipe.render": set(), "engine.config": set(), "agent.processes": {"engine.config"}}
    assert cycles(planted) == []
    assert cycles(package_graph(planted)) == [["agent.codemods", "agent.migrate", "agent.recipe"]]
    assert "agent.codemods.x -> agent.migrate.provenance" in edges_between(planted, ["agent.codemods", "agent.migrate"])
    assert package_of("agent.recipe.native.parts.norm") == "agent.recipe" and package_of("agent.processes") == "agent.processes"
    assert package_of("npu_standin.kernels.quant") == "npu_standin"
    del planted["agent.migrate.vendor"]
    assert cycles(package_graph(planted)) == []


def test_no_import_cycle_between_packages():
    graph = import_graph()
    found = cycles(package_graph(graph))
    assert not found, "package cycles: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(edges_between(graph, c)) + ")" for c in found)


# (importer, imported): a module under the first never imports one under the second. The engine ships
# inside every standalone recipe: it needs neither the migrator nor the stand-in (which marks the
# engine's environment record itself, npu_standin.bootstrap). A recipe on disk is what the run,
# measure and repair layers read; it never reaches up into them.
FORBIDDEN = (("engine", "agent"), ("engine", "npu_standin"),
             ("agent.recipe", "agent.measure"), ("agent.recipe", "agent.repair"), ("agent.recipe", "agent.run"),
             ("agent.recipe", "agent.workflow"), ("npu_standin", "agent.testing"), ("npu_standin", "agent.measure"),
             # the migration step vendors with the codemods into a recipe layout: neither reaches back up into it,
             # and measuring what a migration wrote is the workflow's next step, not the migration's
             ("agent.recipe", "agent.migrate"), ("agent.codemods", "agent.migrate"), ("agent.migrate", "agent.measure"),
             # the lock, the process trees and the provenance texts are the ground floor every package stands on
             ("agent.folder_lock", "agent.recipe"), ("agent.processes", "agent.recipe"), ("agent.provenance", "agent.migrate"),
             # the quantization formats' readers sit below both packages that read a checkpoint's quantization
             ("agent.quantization_formats", "agent.recipe"), ("agent.quantization_formats", "agent.migrate"))


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{name} -> {target}" for name, targets in graph.items() for target in targets
                  for low, high in FORBIDDEN if under(name, low) and under(target, high))


def test_the_layer_check_finds_an_edge_up():
    assert layer_violations({"agent.recipe.spec": {"agent.measure.memory"}, "agent.measure.memory": {"agent.recipe"},
                             "engine.environment": {"npu_standin"}}) == \
        ["agent.recipe.spec -> agent.measure.memory", "engine.environment -> npu_standin"]


def test_no_layer_imports_one_above_it():
    found = layer_violations(import_graph())
    assert not found, "imports up a layer: " + "; ".join(found)


def test_the_engine_never_names_the_standin():
    """Not even through importlib or a module-name string: a recipe's engine runs where no stand-in is."""
    named = [str(p.relative_to(ROOT)) for p in (ROOT / "engine").rglob("*.py") if "npu_standin" in p.read_text()]
    assert not named, f"engine files naming npu_standin: {named}"


def test_no_import_cycle_between_repair_modules():
    """Each of these imports on its own in a fresh interpreter (a cycle shows as an ImportError)."""
    for module in ("agent.repair.failure", "agent.recipe.backup", "agent.repair.rules.rule", "agent.repair.rules.code",
                   "agent.repair.rules.reports", "agent.repair.rules.files", "agent.repair.rules.config",
                   "agent.repair.rules.catalogue", "agent.repair.llm_repair", "agent.codemods.driver", "agent.repair.diagnose",
                   "agent.repair.fix"):
        proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
        assert proc.returncode == 0, (module, proc.stderr[-1500:])
