"""CodemodTest before/after tests of the device commands (incidental NPU / CUDA calls -> device_ops)
and of the torch_npu guard as the repairs run it."""

from libcst.codemod import CodemodTest

from agent.codemods.commands.cuda_calls_to_device_ops import CudaCallsToDeviceOpsCommand
from agent.codemods.commands.npu_calls_to_device_ops import NpuCallsToDeviceOpsCommand
from agent.codemods.commands.npu_device_string import NpuDeviceStringCommand
from agent.codemods.commands.npu_tensor_method import NpuTensorMethodCommand
from agent.codemods.commands.torch_npu_guard import TorchNpuImportGuardCommand
from agent.repair.rules.code import npu_kernel_uses


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


class TestGuardTorchNpuImport(CodemodTest):
    TRANSFORM = TorchNpuImportGuardCommand
    CAUGHT = "except Exception:  # NPU backend: not installed, or installed without the CANN runtime\n"

    def test_noop(self):
        code = "import torch\ntry:\n    import torch_npu\nexcept ImportError:\n    torch_npu = None\n"
        self.assertCodemod(code, code)

    def test_incidental_imports_are_guarded(self):
        before = "import torch\nimport torch_npu\nfrom torch_npu.contrib import transfer_to_npu\n\nx = torch.ones(1)\n"
        after = (f"import torch\ntry:\n    import torch_npu\n{self.CAUGHT}"
                 f"    torch_npu = None\ntry:\n    from torch_npu.contrib import transfer_to_npu\n"
                 f"{self.CAUGHT}    transfer_to_npu = None\n\nx = torch.ones(1)\n")
        self.assertCodemod(before, after)

    def test_import_used_by_a_kernel_stays(self):
        code = "import torch_npu\n\ny = torch_npu.npu_rms_norm(x, w)\n"
        self.assertCodemod(code, code, expected_warnings=["torch_npu is used beyond its import: left as is"])

    def test_a_repair_adds_no_import(self):
        code = "import torch\n\nx = torch.ones(1)\n"
        self.assertCodemod(code, code)


def test_npu_kernel_uses_names_kernels_only():
    source = ("import torch_npu\ntorch.npu.synchronize()\ny = torch_npu.npu_fused_infer_attention_score(q, k, v)\n"
              "z = torch.ops.npu.npu_rms_norm(x)\nfrom torch_npu.contrib import transfer_to_npu\n")
    assert npu_kernel_uses(source) == ["torch.ops.npu", "torch_npu.npu_fused_infer_attention_score"]
    assert npu_kernel_uses("torch.npu.synchronize()\nx = x.npu()\n") == []


def test_device_ops_on_cpu_are_portable(monkeypatch):
    """engine.device_ops on this CPU host: bookkeeping calls are no-ops, events time the host, handles are cpu."""
    import time

    import torch

    from engine import device_ops

    monkeypatch.setenv("RECIPE_DEVICE", "cpu")
    assert device_ops.device_type() == "cpu" and not device_ops.is_available()
    assert device_ops.device(1) == torch.device("cpu") and device_ops.device("npu:1") == torch.device("cpu")
    assert device_ops.device(torch.device("cuda", 1)) == torch.device("cpu")
    device_ops.set_device(0)
    device_ops.set_device(device_ops.device(0))
    device_ops.synchronize()
    device_ops.empty_cache()
    device_ops.reset_peak_memory_stats()
    assert device_ops.max_memory_allocated() == 0 and device_ops.device_count() == 0
    start, end = device_ops.Event(enable_timing=True), device_ops.Event(enable_timing=True)
    start.record()
    time.sleep(0.01)
    end.record()
    end.synchronize()
    assert 5.0 < start.elapsed_time(end) < 1000.0
    with device_ops.stream(device_ops.Stream()):
        x = torch.ones(2).to(device_ops.device())
    assert x.device.type == "cpu"
    device_ops.manual_seed(3)
    a = torch.rand(2)
    device_ops.manual_seed(3)
    assert torch.equal(a, torch.rand(2))


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


class TestRopeScalingTypeKey(CodemodTest):
    from agent.codemods.commands.rope_scaling_type_key import RopeScalingTypeKeyCommand as TRANSFORM

    def test_noop(self):
        code = "kind = config.rope_scaling['rope_type']\nconfig.rope_scaling['type'] = 'linear'\nx = other['type']\n"
        self.assertCodemod(code, code)

    def test_type_key_reads_rope_type_too(self):
        before = 'scaling_type = self.config.rope_scaling["type"]\nf = rope_scaling["type"]\n'
        after = ('scaling_type = self.config.rope_scaling.get("type", self.config.rope_scaling.get("rope_type"))\n'
                 'f = rope_scaling.get("type", rope_scaling.get("rope_type"))\n')
        self.assertCodemod(before, after)


def test_device_ops_keep_npu_behaviour_with_a_faked_npu_backend(monkeypatch):
    """No NPU here: torch.npu is a recording stand-in, to check device_ops forwards to it on an NPU."""
    import types

    import torch

    from engine import device_ops

    calls = []
    fake = types.SimpleNamespace(
        synchronize=lambda *a: calls.append(("synchronize",) + a),
        set_device=lambda d: calls.append(("set_device", d)),
        empty_cache=lambda: calls.append(("empty_cache",)),
        max_memory_allocated=lambda: 123,
        device_count=lambda: 8,
        current_device=lambda: 3,
        Event=lambda **kw: ("npu-event", kw),
    )
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    monkeypatch.setattr(device_ops, "current", lambda: types.SimpleNamespace(type="npu", index=3))
    device_ops.synchronize()
    device_ops.set_device(5)
    device_ops.empty_cache()
    assert calls == [("synchronize",), ("set_device", 5), ("empty_cache",)]
    assert device_ops.max_memory_allocated() == 123 and device_ops.device_count() == 8
    assert device_ops.current_device() == 3 and device_ops.device_type() == "npu"
    assert device_ops.Event(enable_timing=True) == ("npu-event", {"enable_timing": True})
