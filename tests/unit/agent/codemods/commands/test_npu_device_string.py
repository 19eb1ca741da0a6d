"""agent/codemods/commands/npu_device_string.py: 'npu' device strings in a recipe rewritten to engine.device_ops."""

from libcst.codemod import CodemodTest

from agent.codemods.commands.npu_device_string import NpuDeviceStringCommand


class TestNpuDeviceString(CodemodTest):
    TRANSFORM = NpuDeviceStringCommand

    def test_noop(self):
        code = "import torch\n\nd = torch.device('cuda', 0)\nx = torch.zeros(2, device='cpu')\nif kind == 'npu':\n    pass\n"
        self.assertCodemod(code, code)

    def test_device_handles(self):
        before = ("import torch\n\nd = torch.device('npu', rank)\ne = torch.device(\"npu:0\")\nf = torch.device(f\"npu:{i}\")\n"
                  "x = torch.zeros(2, device='npu')\ny = x.to('npu:1', non_blocking=True)\n")
        after = ("import torch\nfrom engine import device_ops\n\nd = device_ops.device(rank)\ne = device_ops.device(0)\n"
                 "f = device_ops.device(i)\nx = torch.zeros(2, device=device_ops.device())\n"
                 "y = x.to(device_ops.device(1), non_blocking=True)\n")
        self.assertCodemod(before, after)
