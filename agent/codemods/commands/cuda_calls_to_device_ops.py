"""torch.cuda.X calls that fail without CUDA rewritten to engine.device_ops."""

from __future__ import annotations

import libcst as cst

from engine.device_ops import PORTABLE

from agent.codemods._toolkit import TORCH_CUDA, DeviceOpsCommand, attribute_to_device_ops

# torch.cuda calls that fail without CUDA (is_available / device_count / manual_seed do not).
CUDA_PORTABLE = PORTABLE - {"is_available", "device_count", "manual_seed", "manual_seed_all"}


class CudaCallsToDeviceOpsCommand(DeviceOpsCommand):
    DESCRIPTION = "Rewrite torch.cuda.X calls that fail without CUDA (set_device, Event, memory stats...) to engine.device_ops."

    def leave_Attribute(self, original_node: cst.Attribute, updated_node: cst.Attribute) -> cst.BaseExpression:
        return attribute_to_device_ops(self, original_node, updated_node, TORCH_CUDA, CUDA_PORTABLE)
