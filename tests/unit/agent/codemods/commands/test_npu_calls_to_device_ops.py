"""agent/codemods/commands/npu_calls_to_device_ops.py: incidental torch.npu calls of a recipe rewritten to
engine.device_ops, and the repairs' NPU commands' output run on this CPU host."""

from libcst.codemod import CodemodTest

from agent.codemods.commands.npu_calls_to_device_ops import NpuCallsToDeviceOpsCommand


class TestNpuCallsToDeviceOps(CodemodTest):
    TRANSFORM = NpuCallsToDeviceOpsCommand

    def test_noop(self):
        code = "import torch\n\ntorch.cuda.is_available()\nx = torch.ones(2)\n"
        self.assertCodemod(code, code)

    def test_torch_npu_calls(self):
        before = ("import torch\n\ndef step(model, i):\n    torch.npu.set_device(i)\n    start = torch.npu.Event(enable_timing=True)\n"
                  "    out = model()\n    torch.npu.synchronize()\n    torch.npu.empty_cache()\n"
                  "    return out, torch.npu.max_memory_allocated() / 2**30\n")
        after = ("import torch\nfrom engine import device_ops\n\ndef step(model, i):\n    device_ops.set_device(i)\n"
                 "    start = device_ops.Event(enable_timing=True)\n    out = model()\n    device_ops.synchronize()\n"
                 "    device_ops.empty_cache()\n    return out, device_ops.max_memory_allocated() / 2**30\n")
        self.assertCodemod(before, after)

    def test_torch_npu_npu_and_is_available(self):
        before = ("import torch_npu\n\nif torch_npu.npu.is_available():\n    torch_npu.npu.manual_seed(0)\n"
                  "with torch.npu.stream(torch.npu.Stream()):\n    pass\n")
        after = ("import torch_npu\nfrom engine import device_ops\n\nif device_ops.device_type() == \"npu\":\n"
                 "    device_ops.manual_seed(0)\nwith device_ops.stream(device_ops.Stream()):\n    pass\n")
        self.assertCodemod(before, after)

    def test_kernels_and_unknown_attributes_stay(self):
        code = ("import torch_npu\n\ny = torch_npu.npu_rms_norm(x, w, 1e-6)[0]\nz = torch.npu.get_device_name(0)\n"
                "torch.npu.config.allow_internal_format = False\n")
        self.assertCodemod(code, code)


def test_rewritten_recipe_code_runs_on_cpu(monkeypatch):
    """The codemods' output runs here for real (the original raises: no torch.npu on this host)."""
    import torch

    from agent.codemods.driver import transform
    from agent.repair.rules.code import NPU_COMMANDS

    monkeypatch.setenv("RECIPE_DEVICE", "cpu")
    source = ("import torch\nimport torch_npu\n\ndef step(x, i):\n    torch.npu.set_device(i)\n    x = x.npu()\n"
              "    y = torch.zeros(2, device='npu')\n    torch.npu.synchronize()\n    d = torch.device('npu', i)\n"
              "    return (x + y).to(d), torch.npu.is_available()\n")
    original = {}
    exec(compile(source.replace("import torch_npu\n", ""), "<npu>", "exec"), original)
    try:
        original["step"](torch.ones(2), 0)
        raise AssertionError("the NPU-only code ran on a host without torch_npu")
    except AttributeError as exc:
        assert "has no attribute 'npu'" in str(exc)
    namespace = {}
    exec(compile(transform(source, NPU_COMMANDS), "<portable>", "exec"), namespace)
    out, on_npu = namespace["step"](torch.ones(2), 0)
    assert out.device.type == "cpu" and torch.equal(out, torch.ones(2)) and on_npu is False
