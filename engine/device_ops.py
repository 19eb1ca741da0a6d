"""Device-agnostic stand-ins for the torch.npu / torch.cuda calls recipes make in passing.

A recipe written for one accelerator calls `torch.npu.synchronize()`, `torch.cuda.set_device(i)`,
`x.npu()`... for bookkeeping, not for a kernel. `agent.codemods.device` rewrites those calls to
the functions here, which do the same thing on the device the recipe really runs on: the NPU
(through torch.npu, so NPU behaviour is kept), a CUDA GPU, or the CPU (where synchronising,
caching and streams are no-ops and events measure host time).

The device is the one the engine selected (ModelRunner exports it as RECIPE_DEVICE), else
`engine.environment.select_device("auto")`. Nothing here imports torch_npu itself.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

from engine.environment import device_module, import_torch, select_device


@functools.lru_cache(maxsize=None)
def _selected(spec: str):
    return select_device(spec)


def current():
    """The torch.device this recipe runs on."""
    return _selected(os.environ.get("RECIPE_DEVICE", "auto"))


def device_type() -> str:
    """"npu", "cuda" or "cpu"."""
    return current().type


def _backend():
    """torch.npu or torch.cuda for the current device; None on the CPU."""
    return device_module(device_type())


def device(index=None):
    """torch.device of the recipe's device type, with the index of `index` (int, "npu:1", a torch.device)
    when given (ignored on the CPU)."""
    torch = import_torch()
    if isinstance(index, torch.device):  # a handle of another type: keep its index
        index = index.index
    if isinstance(index, str):          # "npu:1" / "cuda" / "cpu": keep the index, use our type
        index = int(index.split(":")[1]) if ":" in index else None
    dev = current()
    if dev.type == "cpu":
        return torch.device("cpu")
    return torch.device(dev.type, dev.index if index is None else index)


def is_available() -> bool:
    return _backend() is not None


def device_count() -> int:
    backend = _backend()
    return backend.device_count() if backend is not None else 0


def current_device() -> int:
    backend = _backend()
    return backend.current_device() if backend is not None else 0


def set_device(index) -> None:
    backend = _backend()
    if backend is not None:
        backend.set_device(index if isinstance(index, int) else device(index))


def synchronize(dev=None) -> None:
    backend = _backend()
    if backend is not None:
        backend.synchronize()


def empty_cache() -> None:
    backend = _backend()
    if backend is not None:
        backend.empty_cache()


def manual_seed(seed: int) -> None:
    torch = import_torch()
    torch.manual_seed(seed)
    backend = _backend()
    if backend is not None:
        backend.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    torch = import_torch()
    torch.manual_seed(seed)
    backend = _backend()
    if backend is not None:
        backend.manual_seed_all(seed)


def _memory(name: str, dev=None) -> int:
    backend = _backend()
    return int(getattr(backend, name)()) if backend is not None else 0


def memory_allocated(dev=None) -> int:
    return _memory("memory_allocated")


def max_memory_allocated(dev=None) -> int:
    return _memory("max_memory_allocated")


def memory_reserved(dev=None) -> int:
    return _memory("memory_reserved")


def max_memory_reserved(dev=None) -> int:
    return _memory("max_memory_reserved")


def reset_peak_memory_stats(dev=None) -> None:
    backend = _backend()
    if backend is not None:
        backend.reset_peak_memory_stats()


class _HostEvent:
    """CPU stand-in for torch.npu.Event / torch.cuda.Event: records host time."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream=None) -> None:
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_HostEvent") -> float:
        """Milliseconds between this event and `end` (as torch's events report)."""
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time: both events must be recorded first")
        return (end._t - self._t) * 1000.0


class _HostStream:
    """CPU stand-in for a device stream: work runs in order on the host."""

    def __init__(self, device=None, priority: int = 0):
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event or _HostEvent()
        event.record()
        return event


def Event(*args, **kwargs):  # noqa: N802 - mirrors torch.npu.Event / torch.cuda.Event
    backend = _backend()
    return backend.Event(*args, **kwargs) if backend is not None else _HostEvent(*args, **kwargs)


def Stream(*args, **kwargs):  # noqa: N802 - mirrors torch.npu.Stream / torch.cuda.Stream
    backend = _backend()
    return backend.Stream(*args, **kwargs) if backend is not None else _HostStream(*args, **kwargs)


def current_stream(dev=None):
    backend = _backend()
    return backend.current_stream() if backend is not None else _HostStream()


def stream(s):
    """Context manager selecting a stream (a no-op on the CPU)."""
    backend = _backend()
    return backend.stream(s) if backend is not None else contextlib.nullcontext(s)


# Names a recipe may call on torch.npu / torch.cuda / torch_npu.npu that this module provides.
PORTABLE = frozenset({
    "is_available", "device_count", "current_device", "set_device", "synchronize", "empty_cache",
    "manual_seed", "manual_seed_all", "memory_allocated", "max_memory_allocated", "memory_reserved",
    "max_memory_reserved", "reset_peak_memory_stats", "Event", "Stream", "current_stream", "stream",
})
