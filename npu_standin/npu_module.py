"""`torch.npu` (and `torch_npu.npu`) under the stand-in: the device module of the host device.

On a cuda host every call goes to `torch.cuda` with the device mapped. On the cpu, the host runs each
operation when it is issued, in program order: a stream's work is complete before the next call
returns, so waits are satisfied at once, `query()` is True and `synchronize()` returns at once;
an event's `record()` marks the host time it was issued at, and `elapsed_time()` measures between
two of them (host time, not device time). Memory counters are not tracked on the cpu (0, noted once).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import types

import torch

from npu_standin import device as _dev
from npu_standin import record
from npu_standin.errors import call_site

CPU_LOGICAL_DEVICES = 16   # npu:0 .. npu:15 all land on the cpu (one A3 node's worth of ranks)


def _cuda() -> bool:
    return _dev.host_type() == "cuda"


def _index(device) -> int | None:
    """An NPU index from an int, "npu:N", or a (host) torch.device; None for the current one."""
    if device is None:
        return None
    if type(device) is int:
        return device
    if type(device) is str:
        index = _dev._npu_index(device.strip())
        if index is not False:
            return index
        mapped = torch.device(device)
        return mapped.index
    if isinstance(device, torch.device):
        return device.index
    return None


def _cuda_device(device):
    index = _index(device)
    return torch.device("cuda", index if index is not None else torch.cuda.current_device())


# ---- devices --------------------------------------------------------------------------------
def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def init() -> None:
    return None


def _lazy_init() -> None:
    return None


def device_count() -> int:
    if _cuda():
        return torch.cuda.device_count()
    return int(os.environ.get("NPU_STANDIN_CPU_DEVICES", CPU_LOGICAL_DEVICES))


def current_device() -> int:
    if _cuda():
        return torch.cuda.current_device()
    return _dev.current_index()


def set_device(device) -> None:
    record.runtime("torch.npu.set_device")
    index = _index(device)
    if _cuda():
        torch.cuda.set_device(index if index is not None else torch.cuda.current_device())
        return
    if index is not None:
        _dev.set_current_index(index)


class device:  # noqa: N801 - torch.npu.device(idx) context manager
    def __init__(self, device):
        self.index = _index(device)
        self.previous = None

    def __enter__(self):
        self.previous = current_device()
        if self.index is not None:
            set_device(self.index)
        return self

    def __exit__(self, *exc):
        set_device(self.previous)
        return False


def get_device_name(device=None) -> str:
    if _cuda():
        return f"npu stand-in (cuda: {torch.cuda.get_device_name(_cuda_device(device))})"
    return "npu stand-in (cpu)"


class _HostProperties(types.SimpleNamespace):
    pass


def get_device_properties(device=None):
    if _cuda():
        return torch.cuda.get_device_properties(_cuda_device(device))
    free, total = mem_get_info()
    return _HostProperties(name=get_device_name(), total_memory=total, multi_processor_count=os.cpu_count() or 1,
                           major=0, minor=0, is_npu_standin=True)


def get_device_capability(device=None):
    if _cuda():
        return torch.cuda.get_device_capability(_cuda_device(device))
    return (0, 0)


def is_bf16_supported(*args, **kwargs) -> bool:
    return True


def synchronize(device=None) -> None:
    record.runtime("torch.npu.synchronize")
    if _cuda():
        torch.cuda.synchronize(_cuda_device(device))


def set_compile_mode(jit_compile: bool = False) -> None:
    record.note("set_compile_mode", "torch.npu.set_compile_mode: no NPU op compilation on the stand-in (ignored)",
                echo=False)


def set_per_process_memory_fraction(fraction, device=None) -> None:
    if _cuda():
        torch.cuda.set_per_process_memory_fraction(fraction, _cuda_device(device))


# ---- memory ---------------------------------------------------------------------------------
def _meminfo() -> tuple[int, int]:
    values = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    total = values.get("MemTotal", 0)
    return values.get("MemAvailable", total), total


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of the host device: the cuda card, or the host's RAM."""
    record.runtime("torch.npu.mem_get_info")
    if _cuda():
        return torch.cuda.mem_get_info(_cuda_device(device))
    return _meminfo()


def _cpu_untracked(name: str):
    record.note(f"memory:{name}", f"torch.npu.{name}: device memory is not tracked on the cpu stand-in (0)")
    return 0


def _memory_fn(name: str):
    def fn(device=None):
        if _cuda():
            return getattr(torch.cuda, name)(_cuda_device(device))
        return _cpu_untracked(name)

    fn.__name__ = name
    return fn


memory_allocated = _memory_fn("memory_allocated")
max_memory_allocated = _memory_fn("max_memory_allocated")
memory_reserved = _memory_fn("memory_reserved")
max_memory_reserved = _memory_fn("max_memory_reserved")


def reset_peak_memory_stats(device=None) -> None:
    if _cuda():
        torch.cuda.reset_peak_memory_stats(_cuda_device(device))


def reset_max_memory_allocated(device=None) -> None:
    if _cuda():
        torch.cuda.reset_max_memory_allocated(_cuda_device(device))


def memory_stats(device=None) -> dict:
    if _cuda():
        return torch.cuda.memory_stats(_cuda_device(device))
    _cpu_untracked("memory_stats")
    return {}


def memory_summary(device=None, abbreviated=False) -> str:
    if _cuda():
        return torch.cuda.memory_summary(_cuda_device(device), abbreviated)
    return "npu stand-in (cpu): device memory is not tracked"


def empty_cache() -> None:
    if _cuda():
        torch.cuda.empty_cache()


# ---- random ---------------------------------------------------------------------------------
def manual_seed(seed) -> None:
    (torch.cuda.manual_seed if _cuda() else torch.manual_seed)(seed)


def manual_seed_all(seed) -> None:
    (torch.cuda.manual_seed_all if _cuda() else torch.manual_seed)(seed)


def seed() -> None:
    (torch.cuda.seed if _cuda() else torch.seed)()


def seed_all() -> None:
    (torch.cuda.seed_all if _cuda() else torch.seed)()


def initial_seed() -> int:
    return (torch.cuda.initial_seed if _cuda() else torch.initial_seed)()


def get_rng_state(device="npu"):
    return torch.cuda.get_rng_state(_cuda_device(device)) if _cuda() else torch.get_rng_state()


def set_rng_state(new_state, device="npu") -> None:
    if _cuda():
        torch.cuda.set_rng_state(new_state, _cuda_device(device))
    else:
        torch.set_rng_state(new_state)


# ---- streams and events ---------------------------------------------------------------------
class HostEvent:
    """torch.npu.Event on the cpu: marks the host time at which it was recorded."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._time = None

    def record(self, stream=None):
        record.runtime("torch.npu.Event.record")
        if record.compiling():         # inside a captured graph: an ordering mark, no host time to take
            return
        self._time = time.perf_counter()

    def wait(self, stream=None) -> None:
        record.runtime("torch.npu.Event.wait")

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event) -> float:
        if not (self.enable_timing and getattr(end_event, "enable_timing", False)):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._time is None or end_event._time is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._time - self._time) * 1000.0

    def __repr__(self):
        return f"<torch.npu.Event (npu stand-in, cpu) recorded={self._time is not None}>"


class HostStream(_dev.HostOrderedStream):
    """torch.npu.Stream on the cpu: the host's program order (work is done when a call returns)."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = _dev.host_device(None)
        self.priority = priority

    def wait_event(self, event) -> None:
        record.runtime("torch.npu.Stream.wait_event")

    def wait_stream(self, stream) -> None:
        record.runtime("torch.npu.Stream.wait_stream")

    def record_event(self, event=None):
        event = event or HostEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    @property
    def npu_stream(self) -> int:
        return 0

    def __enter__(self):
        self._context = stream(self)
        return self._context.__enter__()

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)

    def __repr__(self):
        return f"<torch.npu.Stream (npu stand-in, cpu) priority={self.priority}>"


_local = threading.local()
_DEFAULT_STREAM = None


def _default_host_stream() -> HostStream:
    global _DEFAULT_STREAM
    if _DEFAULT_STREAM is None:
        _DEFAULT_STREAM = HostStream()
    return _DEFAULT_STREAM


def Stream(device=None, priority: int = 0, **kwargs):  # noqa: N802 - a class in torch_npu
    record.runtime("torch.npu.Stream")
    if _cuda():
        return torch.cuda.Stream(device=_cuda_device(device), priority=priority, **kwargs)
    return HostStream(device, priority, **kwargs)


def Event(enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **kwargs):  # noqa: N802
    record.runtime("torch.npu.Event")
    if _cuda():
        return torch.cuda.Event(enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)
    return HostEvent(enable_timing, blocking, interprocess)


def current_stream(device=None):
    if _cuda():
        return torch.cuda.current_stream(_cuda_device(device))
    return getattr(_local, "stream", None) or _default_host_stream()


def default_stream(device=None):
    if _cuda():
        return torch.cuda.default_stream(_cuda_device(device))
    return _default_host_stream()


def set_stream(s) -> None:
    if _cuda():
        torch.cuda.set_stream(s)
    else:
        _local.stream = s


@contextlib.contextmanager
def stream(s):
    """torch.npu.stream(s): work inside is issued on `s`."""
    record.runtime("torch.npu.stream")
    if _cuda():
        with torch.cuda.stream(s):
            yield s
        return
    previous = getattr(_local, "stream", None)
    _local.stream = s
    try:
        yield s
    finally:
        _local.stream = previous


StreamContext = stream


# ---- config, amp, graph compile -------------------------------------------------------------
config = types.SimpleNamespace(allow_internal_format=False)
amp = types.SimpleNamespace(autocast=lambda *args, **kwargs: torch.autocast(_dev.host_type(), *args, **kwargs))


class _UnknownAttribute(AttributeError):
    pass


class NpuModule(types.ModuleType):
    """A module whose unknown attributes fail with one line naming them and the caller."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        # Not recorded as a failure: hasattr() probes land here too.
        raise _UnknownAttribute(f"npu stand-in: torch.npu.{name} is not provided (used at {call_site()})")


EXPORTS = (
    "is_available", "is_initialized", "init", "_lazy_init", "device_count", "current_device", "set_device",
    "device", "get_device_name", "get_device_properties", "get_device_capability", "is_bf16_supported",
    "synchronize", "set_compile_mode", "set_per_process_memory_fraction", "mem_get_info", "memory_allocated",
    "max_memory_allocated", "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats",
    "reset_max_memory_allocated", "memory_stats", "memory_summary", "empty_cache", "manual_seed",
    "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state", "set_rng_state", "Stream", "Event",
    "current_stream", "default_stream", "set_stream", "stream", "StreamContext", "config", "amp",
)


def build() -> NpuModule:
    from npu_standin import compile as _compile

    module = NpuModule("torch_npu.npu", __doc__)
    for name in EXPORTS:
        setattr(module, name, globals()[name])
    module.npugraph_ex = _compile.npugraph_ex_module()
    module.__npu_standin__ = True
    module.__file__ = __file__
    return module


def install() -> NpuModule:
    module = sys.modules.get("torch_npu.npu")
    if module is None or not getattr(module, "__npu_standin__", False):
        module = build()
        sys.modules["torch_npu.npu"] = module
    from npu_standin.patches import replace

    replace(torch, "npu", lambda real: module)
    sys.modules["torch.npu"] = module
    return module
