"""Codemods that make incidental NPU / CUDA calls portable through engine.device_ops.

A recipe written on an NPU calls `torch.npu.synchronize()`, `x.npu()`, `torch.device("npu", i)`
and `import torch_npu` for bookkeeping; on a CUDA or CPU host those fail although each has a
device-agnostic equivalent. These commands rewrite them to `engine.device_ops`, which keeps the
NPU behaviour on an NPU. NPU kernels (`torch_npu.npu_*`, `torch.ops.npu.*`) have no portable
equivalent: `npu_kernel_uses` finds them and no command here touches them.
"""

from __future__ import annotations

import re

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor

from engine.device_ops import PORTABLE

# NPU kernels and private ops: nothing portable stands in for them (exit 4 elsewhere).
NPU_KERNEL_RE = re.compile(r"\btorch_npu\.(?:npu_\w+|_npu_\w+|_C\b)|\btorch\.ops\.npu\b|\btorch_npu\.contrib\.(?!transfer_to_npu)\w+")

_TORCH_NPU = m.Attribute(value=m.Name("torch"), attr=m.Name("npu"))
_TORCH_NPU_NPU = m.Attribute(value=m.Name("torch_npu"), attr=m.Name("npu"))
_TORCH_CUDA = m.Attribute(value=m.Name("torch"), attr=m.Name("cuda"))
_NPU_STRING = re.compile(r"""^[rbuRBU]?(['"])npu(?::(\d+))?\1$""")
# torch.cuda calls that fail without CUDA (is_available / device_count / manual_seed do not).
CUDA_PORTABLE = PORTABLE - {"is_available", "device_count", "manual_seed", "manual_seed_all"}


def npu_kernel_uses(source: str) -> list[str]:
    """The NPU kernels / private ops a source calls (sorted, unique)."""
    return sorted(set(NPU_KERNEL_RE.findall(source)))


def _device_ops(attr: str, *args: cst.Arg) -> cst.Call:
    return cst.Call(func=cst.Attribute(value=cst.Name("device_ops"), attr=cst.Name(attr)), args=list(args))


def _bare(arg: cst.Arg) -> cst.Arg:
    return arg.with_changes(comma=cst.MaybeSentinel.DEFAULT, keyword=None, equal=cst.MaybeSentinel.DEFAULT)


def _npu_index(node: cst.BaseExpression) -> tuple[bool, cst.Arg | None]:
    """("npu" string?, index arg) for "npu" / "npu:1" / f"npu:{i}"."""
    if isinstance(node, cst.SimpleString):
        found = _NPU_STRING.match(node.value)
        if not found:
            return False, None
        return True, (cst.Arg(cst.Integer(found.group(2))) if found.group(2) else None)
    if isinstance(node, cst.FormattedString) and len(node.parts) == 2 \
            and m.matches(node.parts[0], m.FormattedStringText(value="npu:")) \
            and isinstance(node.parts[1], cst.FormattedStringExpression) and node.parts[1].conversion is None \
            and node.parts[1].format_spec is None:
        return True, cst.Arg(node.parts[1].expression)
    return False, None


class _DeviceOpsCommand(VisitorBasedCodemodCommand):
    def _uses_device_ops(self) -> None:
        AddImportsVisitor.add_needed_import(self.context, "engine", "device_ops")


class NpuCallsToDeviceOpsCommand(_DeviceOpsCommand):
    DESCRIPTION = "Rewrite torch.npu.X / torch_npu.npu.X bookkeeping calls (synchronize, set_device, Event...) to engine.device_ops."

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if m.matches(original_node.func, m.Attribute(value=_TORCH_NPU | _TORCH_NPU_NPU, attr=m.Name("is_available"))) \
                and not original_node.args:
            self._uses_device_ops()
            return cst.Comparison(left=_device_ops("device_type"), comparisons=[cst.ComparisonTarget(
                operator=cst.Equal(), comparator=cst.SimpleString('"npu"'))])
        return updated_node

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> cst.BaseExpression:
        if m.matches(original_node.value, _TORCH_NPU | _TORCH_NPU_NPU) and original_node.attr.value in PORTABLE \
                and original_node.attr.value != "is_available":
            self._uses_device_ops()
            return cst.Attribute(value=cst.Name("device_ops"), attr=updated_node.attr)
        return updated_node


class CudaCallsToDeviceOpsCommand(_DeviceOpsCommand):
    DESCRIPTION = "Rewrite torch.cuda.X calls that fail without CUDA (set_device, Event, memory stats...) to engine.device_ops."

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> cst.BaseExpression:
        if m.matches(original_node.value, _TORCH_CUDA) and original_node.attr.value in CUDA_PORTABLE:
            self._uses_device_ops()
            return cst.Attribute(value=cst.Name("device_ops"), attr=updated_node.attr)
        return updated_node


class NpuTensorMethodCommand(_DeviceOpsCommand):
    DESCRIPTION = "Rewrite x.npu() / x.npu(i) on tensors and modules to x.to(device_ops.device(i))."

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        func = updated_node.func
        if not (isinstance(func, cst.Attribute) and func.attr.value == "npu") \
                or m.matches(func.value, m.Name("torch") | m.Name("torch_npu")):
            return updated_node
        positional = [a for a in updated_node.args if a.keyword is None and not a.star]
        index = [a for a in updated_node.args if a.keyword is not None and a.keyword.value == "device"] or positional
        keep = [a for a in updated_node.args if a.keyword is not None and a.keyword.value == "non_blocking"]
        if len(updated_node.args) != len(index[:1]) + len(keep):
            self.warn("x.npu(...) with arguments other than device / non_blocking: left as is")
            return updated_node
        self._uses_device_ops()
        args = [cst.Arg(_device_ops("device", *[_bare(a) for a in index[:1]]))]
        if keep:
            args[0] = args[0].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            args.append(keep[0].with_changes(comma=cst.MaybeSentinel.DEFAULT))
        return updated_node.with_changes(func=func.with_changes(attr=cst.Name("to")), args=args)


class NpuDeviceStringCommand(_DeviceOpsCommand):
    DESCRIPTION = "Rewrite NPU device handles (torch.device(\"npu\", i), device=\"npu:0\", .to(\"npu\")) to device_ops.device(i)."

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        args = updated_node.args
        if m.matches(updated_node.func, m.Attribute(value=m.Name("torch"), attr=m.Name("device"))) and args \
                and args[0].keyword is None:
            is_npu, index = _npu_index(args[0].value)
            if is_npu and len(args) <= 2 and (len(args) == 1 or index is None):
                if len(args) == 2:
                    index = _bare(args[1])
                self._uses_device_ops()
                return _device_ops("device", *([index] if index is not None else []))
            return updated_node
        if isinstance(updated_node.func, cst.Attribute) and updated_node.func.attr.value == "to" and args \
                and args[0].keyword is None:
            is_npu, index = _npu_index(args[0].value)
            if is_npu:
                self._uses_device_ops()
                new = list(args)
                new[0] = args[0].with_changes(value=_device_ops("device", *([index] if index is not None else [])))
                return updated_node.with_changes(args=new)
        return updated_node

    def leave_Arg(self, original_node: cst.Arg, updated_node: cst.Arg) -> cst.Arg:
        if updated_node.keyword is not None and updated_node.keyword.value == "device":
            is_npu, index = _npu_index(updated_node.value)
            if is_npu:
                self._uses_device_ops()
                return updated_node.with_changes(value=_device_ops("device", *([index] if index is not None else [])))
        return updated_node


def _guardable_import(stmt: cst.BaseSmallStatement) -> list[str] | None:
    """Names bound by `import torch_npu [as x]` / `from torch_npu.contrib import transfer_to_npu`."""
    if isinstance(stmt, cst.Import) and all(m.matches(a.name, m.Name("torch_npu")) for a in stmt.names):
        return [a.asname.name.value if a.asname else "torch_npu" for a in stmt.names]
    if isinstance(stmt, cst.ImportFrom) and not stmt.relative and not isinstance(stmt.names, cst.ImportStar) \
            and m.matches(stmt.module, m.Attribute(value=m.Name("torch_npu"), attr=m.Name("contrib"))) \
            and all(m.matches(a.name, m.Name("transfer_to_npu")) for a in stmt.names):
        return [a.asname.name.value if a.asname else "transfer_to_npu" for a in stmt.names]
    return None


class GuardTorchNpuImportCommand(VisitorBasedCodemodCommand):
    DESCRIPTION = "Make an incidental `import torch_npu` optional: try/except ImportError when nothing else uses the module."

    def __init__(self, context: CodemodContext):
        super().__init__(context)
        self._in_try = 0
        self._module: cst.Module | None = None
        self._used: set[str] = set()

    def visit_Module(self, node: cst.Module) -> None:
        self._module = node
        # Names used outside import statements (torch_npu.npu_rms_norm(...) keeps the import as is).
        collector = _NameUses()
        node.visit(collector)
        self._used = collector.used

    def visit_Try(self, node: cst.Try) -> None:
        self._in_try += 1

    def leave_Try(self, original_node: cst.Try, updated_node: cst.Try) -> cst.Try:
        self._in_try -= 1
        return updated_node

    def leave_SimpleStatementLine(self, original_node, updated_node):
        if self._in_try or len(updated_node.body) != 1:
            return updated_node
        names = _guardable_import(updated_node.body[0])
        if not names:
            return updated_node
        if set(names) & self._used:
            self.warn(f"{', '.join(names)} is used beyond its import: left as is")
            return updated_node
        module = self._module
        indent, newline = module.default_indent, module.default_newline
        import_line = cst.Module(body=[updated_node.with_changes(leading_lines=[])]).code.rstrip("\r\n")
        code = (f"try:{newline}{indent}{import_line}{newline}"
                f"except ImportError:  # NPU backend: optional off an NPU{newline}"
                f"{indent}{' = '.join(dict.fromkeys(names))} = None{newline}")
        guarded = cst.parse_statement(code, config=module.config_for_parsing)
        return guarded.with_changes(leading_lines=updated_node.leading_lines)


class _NameUses(cst.CSTVisitor):
    """Names read anywhere but in import statements."""

    def __init__(self):
        self.used: set[str] = set()

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def visit_Name(self, node: cst.Name) -> None:
        self.used.add(node.value)


# In the order a fix applies them: calls and handles first, then the import they needed.
NPU_COMMANDS: tuple[type[VisitorBasedCodemodCommand], ...] = (
    NpuCallsToDeviceOpsCommand, NpuTensorMethodCommand, NpuDeviceStringCommand, GuardTorchNpuImportCommand)
CUDA_COMMANDS: tuple[type[VisitorBasedCodemodCommand], ...] = (CudaCallsToDeviceOpsCommand,)


def transform(source: str, commands) -> str:
    """Run commands in order on a source (one parse each; AddImportsVisitor runs via transform_module)."""
    for command in commands:
        source = command(CodemodContext()).transform_module(cst.parse_module(source)).code
    return source
