"""agent/codemods/commands/cuda_calls_to_device_ops.py: incidental CUDA calls of a recipe rewritten to
engine.device_ops."""

from libcst.codemod import CodemodTest

from agent.codemods.commands.cuda_calls_to_device_ops import CudaCallsToDeviceOpsCommand


class TestCudaCallsToDeviceOps(CodemodTest):
    TRANSFORM = CudaCallsToDeviceOpsCommand

    def test_noop(self):
        code = "import torch\n\ndevice = 'cuda' if torch.cuda.is_available() else 'cpu'\nn = torch.cuda.device_count()\n"
        self.assertCodemod(code, code)

    def test_cuda_calls(self):
        before = "import torch\n\ntorch.cuda.set_device(0)\ne = torch.cuda.Event(enable_timing=True)\ntorch.cuda.reset_peak_memory_stats()\n"
        after = ("import torch\nfrom engine import device_ops\n\ndevice_ops.set_device(0)\n"
                 "e = device_ops.Event(enable_timing=True)\ndevice_ops.reset_peak_memory_stats()\n")
        self.assertCodemod(before, after)
