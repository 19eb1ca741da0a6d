"""The one guard of `import torch_npu`: the module still loads where torch_npu is missing or cannot load."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext

from agent.codemods._toolkit import DOCSTRING_LINE, IMPORT_LINE, IMPORT_TORCH_LINE
from agent.codemods.commands.guard_optional_import import GuardOptionalImportCommand

# torch_npu installed without the CANN runtime fails with OSError/RuntimeError, not ImportError.
CATCH = "Exception"
REASON = "NPU backend: not installed, or installed without the CANN runtime"
_IMPORTS_TORCH_NPU = m.Import(names=[m.ZeroOrMore(), m.ImportAlias(name=m.Name("torch_npu")), m.ZeroOrMore()]) \
    | m.ImportFrom(module=m.Name("torch_npu") | m.Attribute(value=m.Name("torch_npu")) | m.Attribute(
        value=m.Attribute(value=m.Name("torch_npu"))))


class TorchNpuImportGuardCommand(GuardOptionalImportCommand):
    """Wraps every unguarded `import torch_npu` (and `from torch_npu.contrib import transfer_to_npu`)
    whose names the module uses for nothing else in try/except, binding them to None; an import used
    beyond itself (a kernel call) stays, with a warning. `ensure`: a module that imports torch_npu
    nowhere gets the guarded import after `import torch` (vendored modeling code: the NPU device is
    registered where the model runs)."""

    DESCRIPTION = "Guard `import torch_npu` (with ensure: add one after `import torch`) so the module loads without an NPU."

    def __init__(self, context: CodemodContext, ensure: bool = False):
        super().__init__(context, package="torch_npu", reason=REASON, submodules=False,
                         also=("torch_npu.contrib.transfer_to_npu",), unless_used=True, catch=CATCH)
        self.ensure = ensure

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        if not self.ensure or m.findall(original_node, _IMPORTS_TORCH_NPU):
            return updated_node
        body = list(updated_node.body)
        index = next((i + 1 for i, s in enumerate(body) if m.matches(s, IMPORT_TORCH_LINE)), None)
        if index is None:
            # After the leading block of imports (and a module docstring).
            index = 0
            for i, stmt in enumerate(body):
                if m.matches(stmt, IMPORT_LINE) or (i == 0 and m.matches(stmt, DOCSTRING_LINE)):
                    index = i + 1
                else:
                    break
        indent, newline = updated_node.default_indent, updated_node.default_newline
        guarded = cst.parse_statement(
            f"try:{newline}"
            f'{indent}import torch_npu  # noqa: F401  registers the "npu" device with torch{newline}'
            f"except {CATCH}:  # {REASON}{newline}"
            f"{indent}torch_npu = None{newline}", config=updated_node.config_for_parsing)
        body.insert(index, guarded)
        return updated_node.with_changes(body=body)
