"""torch.npu.X / torch_npu.npu.X bookkeeping calls rewritten to engine.device_ops."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from engine.device_ops import PORTABLE

from agent.codemods._toolkit import TORCH_NPU, TORCH_NPU_NPU, DeviceOpsCommand, attribute_to_device_ops, device_ops_call


class NpuCallsToDeviceOpsCommand(DeviceOpsCommand):
    DESCRIPTION = "Rewrite torch.npu.X / torch_npu.npu.X bookkeeping calls (synchronize, set_device, Event...) to engine.device_ops."

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if m.matches(original_node.func, m.Attribute(value=TORCH_NPU | TORCH_NPU_NPU, attr=m.Name("is_available"))) \
                and not original_node.args:
            self._uses_device_ops()
            return cst.Comparison(left=device_ops_call("device_type"), comparisons=[cst.ComparisonTarget(
                operator=cst.Equal(), comparator=cst.SimpleString('"npu"'))])
        return updated_node

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> cst.BaseExpression:
        # is_available() becomes a comparison with the device type (leave_Call).
        return attribute_to_device_ops(self, original_node, updated_node, TORCH_NPU | TORCH_NPU_NPU,
                                       PORTABLE - {"is_available"})
