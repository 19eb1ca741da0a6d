"""Hard-coded CUDA replaced with the recipe device."""

from __future__ import annotations

import re

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor

from agent.codemods._toolkit import Command, TORCH_CUDA, is_model_class, param_names


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


class DeviceAgnosticCudaCommand(Command):
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
        params = param_names(func.params) if func is not None else []
        if func is not None and params[:1] == ["self"] and len(self._classes) == 1 \
                and len(self._functions) == 1 and is_model_class(self._classes[0]):
            return cst.parse_expression("self.device")
        if func is not None and "hidden_states" in params:
            return cst.parse_expression("hidden_states.device")
        self._needs_device = True
        return cst.parse_expression("_recipe_device()")

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        func = updated_node.func
        if m.matches(func, m.Attribute(value=TORCH_CUDA, attr=m.Name("synchronize"))):
            self._needs_sync = True
            return cst.parse_expression("_recipe_synchronize()")
        if m.matches(func, m.Attribute(value=TORCH_CUDA, attr=m.Name("current_device"))):
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
