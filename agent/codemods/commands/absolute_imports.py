"""Relative imports made absolute; vendored siblings imported as `models.*`."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext

from agent.codemods._toolkit import Command, dotted, remove_from_sequence


class RelativeImportError(ValueError):
    """A relative import climbs above the top-level package it is resolved against."""


class AbsoluteImportsCommand(Command):
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
            module = self._map(f"{base}.{dotted(node.module)}")
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
        rest = remove_from_sequence(node.names, lambda a: a not in siblings)
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
