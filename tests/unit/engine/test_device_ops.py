"""engine/device_ops.py, what recipe code calls instead of torch.npu / torch.cuda: portable no-ops and host
timing on CPU, forwarded to torch.npu on an NPU (a recording stand-in here)."""


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
