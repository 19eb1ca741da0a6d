"""NPU device handles rewritten to device_ops.device(i)."""

from __future__ import annotations

import re

import libcst as cst
import libcst.matchers as m

from agent.codemods._toolkit import DeviceOpsCommand, bare_arg, device_ops_call


_NPU_STRING = re.compile(r"""^[rbuRBU]?(['"])npu(?::(\d+))?\1$""")


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


class NpuDeviceStringCommand(DeviceOpsCommand):
    DESCRIPTION = "Rewrite NPU device handles (torch.device(\"npu\", i), device=\"npu:0\", .to(\"npu\")) to device_ops.device(i)."

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        args = updated_node.args
        if m.matches(updated_node.func, m.Attribute(value=m.Name("torch"), attr=m.Name("device"))) and args \
                and args[0].keyword is None:
            is_npu, index = _npu_index(args[0].value)
            if is_npu and len(args) <= 2 and (len(args) == 1 or index is None):
                if len(args) == 2:
                    index = bare_arg(args[1])
                self._uses_device_ops()
                return device_ops_call("device", *([index] if index is not None else []))
            return updated_node
        if isinstance(updated_node.func, cst.Attribute) and updated_node.func.attr.value == "to" and args \
                and args[0].keyword is None:
            is_npu, index = _npu_index(args[0].value)
            if is_npu:
                self._uses_device_ops()
                new = list(args)
                new[0] = args[0].with_changes(value=device_ops_call("device", *([index] if index is not None else [])))
                return updated_node.with_changes(args=new)
        return updated_node

    def leave_Arg(self, original_node: cst.Arg, updated_node: cst.Arg) -> cst.Arg:
        if updated_node.keyword is not None and updated_node.keyword.value == "device":
            is_npu, index = _npu_index(updated_node.value)
            if is_npu:
                self._uses_device_ops()
                return updated_node.with_changes(value=device_ops_call("device", *([index] if index is not None else [])))
        return updated_node
