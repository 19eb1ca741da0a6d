"""x.npu() / x.npu(i) rewritten to x.to(device_ops.device(i))."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from agent.codemods._toolkit import DeviceOpsCommand, bare_arg, device_ops_call


class NpuTensorMethodCommand(DeviceOpsCommand):
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
        args = [cst.Arg(device_ops_call("device", *[bare_arg(a) for a in index[:1]]))]
        if keep:
            args[0] = args[0].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            args.append(keep[0].with_changes(comma=cst.MaybeSentinel.DEFAULT))
        return updated_node.with_changes(func=func.with_changes(attr=cst.Name("to")), args=args)
