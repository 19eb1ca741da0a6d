"""agent/codemods/commands/npu_tensor_method.py: tensor.npu() in a recipe rewritten to engine.device_ops."""

from libcst.codemod import CodemodTest

from agent.codemods.commands.npu_tensor_method import NpuTensorMethodCommand


class TestNpuTensorMethod(CodemodTest):
    TRANSFORM = NpuTensorMethodCommand

    def test_noop(self):
        code = "import torch\n\nx = x.cuda()\ny = torch.npu\n"
        self.assertCodemod(code, code)

    def test_npu_calls(self):
        before = "x = x.npu()\nmodel = model.npu(1)\ny = y.npu(non_blocking=True)\n"
        after = ("from engine import device_ops\n\nx = x.to(device_ops.device())\nmodel = model.to(device_ops.device(1))\n"
                 "y = y.to(device_ops.device(), non_blocking=True)\n")
        self.assertCodemod(before, after)

    def test_unknown_arguments_stay(self):
        code = "x = x.npu(0, memory_format=fmt)\n"
        self.assertCodemod(code, code, expected_warnings=["x.npu(...) with arguments other than device / non_blocking: left as is"])
