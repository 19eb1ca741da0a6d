"""Unguarded imports of an optional package wrapped in try/except."""

from __future__ import annotations

import libcst as cst
from libcst.codemod import CodemodContext

from agent.codemods._toolkit import Command, NameUses, dotted


class GuardOptionalImportCommand(Command):
    DESCRIPTION = "Wrap unguarded imports of an optional package in try/except ImportError binding their names to None."

    def __init__(self, context: CodemodContext, package: str, reason: str, submodules: bool = True,
                 also: tuple[str, ...] = (), unless_used: bool = False, catch: str = "ImportError"):
        """package: the optional package; submodules: its submodules' imports count too (else only
        `import <package>` and the `from X import Y` named in `also` as "X.Y"); unless_used: leave an
        import whose names the module uses beyond imports; catch: the exception the guard catches."""
        super().__init__(context)
        self.package, self.reason, self.submodules, self.also, self.unless_used, self.catch = \
            package, reason, submodules, set(also), unless_used, catch
        self._in_try = 0
        self._module: cst.Module | None = None
        self._used: set[str] = set()

    def _ours(self, module: str) -> bool:
        return module == self.package or (self.submodules and module.startswith(self.package + "."))

    def _guarded_names(self, stmt: cst.BaseSmallStatement) -> list[str] | None:
        """Names the import binds when it is one to guard ([] for `import *`), else None."""
        if isinstance(stmt, cst.Import):
            modules = [dotted(a.name) for a in stmt.names]
            if not (any(map(self._ours, modules)) if self.submodules else all(map(self._ours, modules))):
                return None
            return [a.asname.name.value if a.asname else dotted(a.name).split(".")[0] for a in stmt.names]
        if isinstance(stmt, cst.ImportFrom) and not stmt.relative and stmt.module is not None:
            module = dotted(stmt.module)
            if isinstance(stmt.names, cst.ImportStar):
                return [] if self._ours(module) else None
            if self._ours(module) or all(f"{module}.{dotted(a.name)}" in self.also for a in stmt.names):
                return [a.asname.name.value if a.asname else dotted(a.name) for a in stmt.names]
        return None

    def visit_Module(self, node: cst.Module) -> None:
        self._module = node
        if self.unless_used:   # names used outside import statements keep their import as is
            collector = NameUses()
            node.visit(collector)
            self._used = collector.used

    def visit_Try(self, node: cst.Try) -> None:
        self._in_try += 1

    def leave_Try(self, original_node: cst.Try, updated_node: cst.Try) -> cst.Try:
        self._in_try -= 1
        return updated_node

    def leave_SimpleStatementLine(self, original_node, updated_node):
        if self._in_try:
            return updated_node
        found = [names for names in map(self._guarded_names, updated_node.body) if names is not None]
        if not found:
            return updated_node
        if len(updated_node.body) != 1:
            self.warn(f"{self.package} import shares a line with other statements: left as is")
            return updated_node
        names = found[0]
        if not names:
            self.warn(f"`from {self.package}... import *` cannot be guarded: left as is")
            return updated_node
        if set(names) & self._used:
            self.warn(f"{', '.join(names)} is used beyond its import: left as is")
            return updated_node
        module = self._module
        indent, newline = module.default_indent, module.default_newline
        import_line = cst.Module(body=[updated_node.with_changes(leading_lines=[])]).code.rstrip("\r\n")
        code = (f"try:{newline}{indent}{import_line}{newline}"
                f"except {self.catch}:  # {self.reason}{newline}"
                f"{indent}{' = '.join(dict.fromkeys(names))} = None{newline}")
        guarded = cst.parse_statement(code, config=module.config_for_parsing)
        return guarded.with_changes(leading_lines=updated_node.leading_lines)


# flash_attn is imported by vendored code for one attention kernel; the others work without it.
GUARD_FLASH_ATTN = {"package": "flash_attn", "reason": "flash_attn is optional: use another attn_implementation"}

# torchair (NPU graph mode) is imported by upstream's recipes next to torch_npu; unused off an NPU.
GUARD_TORCHAIR = {"package": "torchair", "reason": "torchair (NPU graph mode): optional off an NPU",
                  "unless_used": True}
