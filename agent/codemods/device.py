"""Codemods that make incidental NPU / CUDA calls portable through engine.device_ops.

A recipe written on an NPU calls `torch.npu.synchronize()`, `x.npu()`, `torch.device("npu", i)`
and `import torch_npu` for bookkeeping; on a CUDA or CPU host those fail although each has a
device-agnostic equivalent. These commands rewrite them to `engine.device_ops`, which keeps the
NPU behaviour on an NPU. NPU kernels (`torch_npu.npu_*`, `torch.ops.npu.*`) have no portable
equivalent: `npu_kernel_uses` finds them and no command here touches them.
"""

from __future__ import annotations

import re
from functools import partial

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor

from agent.codemods.vendor import _dotted, _is_model_class, _param_names
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


class GuardOptionalImportCommand(VisitorBasedCodemodCommand):
    DESCRIPTION = "Wrap unguarded imports of an optional package in try/except ImportError binding their names to None."

    def __init__(self, context: CodemodContext, package: str, reason: str, submodules: bool = True,
                 also: tuple[str, ...] = (), unless_used: bool = False):
        """package: the optional package; submodules: its submodules' imports count too (else only
        `import <package>` and the `from X import Y` named in `also` as "X.Y"); unless_used: leave an
        import whose names the module uses beyond imports."""
        super().__init__(context)
        self.package, self.reason, self.submodules, self.also, self.unless_used = \
            package, reason, submodules, set(also), unless_used
        self._in_try = 0
        self._module: cst.Module | None = None
        self._used: set[str] = set()

    def _ours(self, module: str) -> bool:
        return module == self.package or (self.submodules and module.startswith(self.package + "."))

    def _guarded_names(self, stmt: cst.BaseSmallStatement) -> list[str] | None:
        """Names the import binds when it is one to guard ([] for `import *`), else None."""
        if isinstance(stmt, cst.Import):
            modules = [_dotted(a.name) for a in stmt.names]
            if not (any(map(self._ours, modules)) if self.submodules else all(map(self._ours, modules))):
                return None
            return [a.asname.name.value if a.asname else _dotted(a.name).split(".")[0] for a in stmt.names]
        if isinstance(stmt, cst.ImportFrom) and not stmt.relative and stmt.module is not None:
            module = _dotted(stmt.module)
            if isinstance(stmt.names, cst.ImportStar):
                return [] if self._ours(module) else None
            if self._ours(module) or all(f"{module}.{_dotted(a.name)}" in self.also for a in stmt.names):
                return [a.asname.name.value if a.asname else _dotted(a.name) for a in stmt.names]
        return None

    def visit_Module(self, node: cst.Module) -> None:
        self._module = node
        if self.unless_used:   # names used outside import statements keep their import as is
            collector = _NameUses()
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
                f"except ImportError:  # {self.reason}{newline}"
                f"{indent}{' = '.join(dict.fromkeys(names))} = None{newline}")
        guarded = cst.parse_statement(code, config=module.config_for_parsing)
        return guarded.with_changes(leading_lines=updated_node.leading_lines)


# The two optional packages recipes import: torch_npu only for bookkeeping, flash_attn for one attention kernel.
GUARD_TORCH_NPU = {"package": "torch_npu", "reason": "NPU backend: optional off an NPU", "submodules": False,
                   "also": ("torch_npu.contrib.transfer_to_npu",), "unless_used": True}
GUARD_TORCHAIR = {"package": "torchair", "reason": "torchair (NPU graph mode): optional off an NPU",
                  "unless_used": True}
GUARD_FLASH_ATTN = {"package": "flash_attn", "reason": "flash_attn is optional: use another attn_implementation"}


class _NameUses(cst.CSTVisitor):
    """Names read anywhere but in import statements."""

    def __init__(self):
        self.used: set[str] = set()

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def visit_Try(self, node: cst.Try) -> bool:
        # `try: import torch_npu / except ...: torch_npu = None`: a guard; its fallback binding is no use
        imports_only = all(isinstance(stmt, cst.SimpleStatementLine) and
                           all(isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body)
                           for stmt in node.body.body)
        return not imports_only

    def visit_Name(self, node: cst.Name) -> None:
        self.used.add(node.value)


# ---- hard-coded CUDA -> the recipe device --------------------------------------------------
_DEVICE_HELPER = '''

@functools.lru_cache(maxsize=None)
def _recipe_device():
    """The device this recipe runs on (replaces hard-coded CUDA; RECIPE_DEVICE overrides)."""
    from engine.environment import select_device

    return select_device(os.environ.get("RECIPE_DEVICE", "auto"))
'''
_SYNC_HELPER = '''

def _recipe_synchronize():
    """Wait for the recipe device's queued work (replaces torch.cuda.synchronize())."""
    from engine.environment import synchronize

    synchronize(_recipe_device())
'''
_CUDA_STRING = re.compile(r"""^[rbuRBU]?(['"])cuda(:\d+)?\1$""")


def _is_cuda_string(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.SimpleString) and bool(_CUDA_STRING.match(node.value))


class DeviceAgnosticCudaCommand(VisitorBasedCodemodCommand):
    DESCRIPTION = "Replace hard-coded CUDA (.cuda(), \"cuda\" devices, torch.cuda.synchronize) with the recipe device."

    def __init__(self, context: CodemodContext):
        super().__init__(context)
        self._classes: list[cst.ClassDef] = []
        self._functions: list[cst.FunctionDef] = []
        self._needs_device = self._needs_sync = False

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._classes.append(node)

    def leave_ClassDef(self, original_node, updated_node):
        self._classes.pop()
        return updated_node

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._functions.append(node)

    def leave_FunctionDef(self, original_node, updated_node):
        self._functions.pop()
        return updated_node

    def _device(self) -> cst.BaseExpression:
        """`self.device` in a model's method, the tensor's device when a hidden_states argument is
        in scope, else the module-level `_recipe_device()` helper."""
        func = self._functions[-1] if self._functions else None
        params = _param_names(func.params) if func is not None else []
        if func is not None and params[:1] == ["self"] and len(self._classes) == 1 \
                and len(self._functions) == 1 and _is_model_class(self._classes[0]):
            return cst.parse_expression("self.device")
        if func is not None and "hidden_states" in params:
            return cst.parse_expression("hidden_states.device")
        self._needs_device = True
        return cst.parse_expression("_recipe_device()")

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        func = updated_node.func
        if m.matches(func, m.Attribute(value=_TORCH_CUDA, attr=m.Name("synchronize"))):
            self._needs_sync = True
            return cst.parse_expression("_recipe_synchronize()")
        if m.matches(func, m.Attribute(value=_TORCH_CUDA, attr=m.Name("current_device"))):
            return self._device()
        if m.matches(func, m.Attribute(value=m.Name("torch"), attr=m.Name("device"))) and updated_node.args \
                and _is_cuda_string(updated_node.args[0].value):
            return self._device()
        if isinstance(func, cst.Attribute) and func.attr.value == "cuda" and not m.matches(func.value, m.Name("torch")):
            # x.cuda(), x.cuda(0), x.cuda(non_blocking=True) -> x.to(<device>[, non_blocking=...])
            keep = [a for a in updated_node.args if a.keyword is not None and a.keyword.value == "non_blocking"]
            args = [cst.Arg(self._device())]
            if keep:
                args[0] = args[0].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
                args.append(keep[0].with_changes(comma=cst.MaybeSentinel.DEFAULT))
            return updated_node.with_changes(func=func.with_changes(attr=cst.Name("to")), args=args)
        if isinstance(func, cst.Attribute) and func.attr.value == "to" and updated_node.args \
                and updated_node.args[0].keyword is None and _is_cuda_string(updated_node.args[0].value):
            args = list(updated_node.args)
            args[0] = args[0].with_changes(value=self._device())
            return updated_node.with_changes(args=args)
        return updated_node

    def leave_Arg(self, original_node: cst.Arg, updated_node: cst.Arg) -> cst.Arg:
        if updated_node.keyword is not None and updated_node.keyword.value == "device" \
                and _is_cuda_string(updated_node.value):
            return updated_node.with_changes(value=self._device())
        return updated_node

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        code = updated_node.code
        helpers = ""
        if (self._needs_device or self._needs_sync) and "def _recipe_device(" not in code:
            helpers += _DEVICE_HELPER
            AddImportsVisitor.add_needed_import(self.context, "functools")
            AddImportsVisitor.add_needed_import(self.context, "os")
        if self._needs_sync and "def _recipe_synchronize(" not in code:
            helpers += _SYNC_HELPER
        if not helpers:
            return updated_node
        new = list(cst.parse_module(helpers.lstrip("\n"), config=updated_node.config_for_parsing).body)
        new[0] = new[0].with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
        body = list(updated_node.body)
        # Before the first module-level class/function, i.e. after imports and constants.
        index = next((i for i, s in enumerate(body) if isinstance(s, (cst.ClassDef, cst.FunctionDef))), len(body))
        if index < len(body):
            body[index] = body[index].with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine()])
        body[index:index] = new
        return updated_node.with_changes(body=body)


# In the order a fix applies them: calls and handles first, then the import they needed.
NPU_COMMANDS = (NpuCallsToDeviceOpsCommand, NpuTensorMethodCommand, NpuDeviceStringCommand,
                partial(GuardOptionalImportCommand, **GUARD_TORCH_NPU),
                partial(GuardOptionalImportCommand, **GUARD_TORCHAIR))
CUDA_COMMANDS = (CudaCallsToDeviceOpsCommand,)


def transform(source: str, commands, context: CodemodContext | None = None) -> str:
    """Run commands (classes, or partials with their arguments bound) in order on a source, one parse
    each; AddImportsVisitor runs via transform_module. `context`: one to share, e.g. to read its scratch."""
    for command in commands:
        source = command(context or CodemodContext()).transform_module(cst.parse_module(source)).code
    return source
