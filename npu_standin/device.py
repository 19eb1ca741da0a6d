"""The device type `npu`, landing on the host device: the reverse of torch_npu's transfer_to_npu.

transfer_to_npu (torch-npu 2.13.0, torch_npu/contrib/transfer_to_npu.py) rewrites "cuda" to "npu"
in the device arguments of torch's factories (`torch_fn_white_list`), of `Tensor.new_*` / `to` /
`pin_memory`, of `nn.Module.to` / `to_empty`, in `torch.Generator` / `torch.Event`, autocast, and
`torch.load(map_location=)`. The stand-in wraps the same entry points the other way: "npu",
"npu:N" and integer device indices become the host device (cpu, or cuda:N). `torch.device("npu", 0)`
itself gives the host device (`torch.device` is a thin class whose isinstance() is the real one),
so every consumer of a device object works unchanged.

A tensor's own `.device` is the host's (`device(type='cpu')`): code that branches on
`tensor.device.type` or hands it to `torch.autocast` takes the host's path. `tensor.is_npu` is True
for tensors on the stand-in's device.
"""

from __future__ import annotations

import functools
import os
import threading

import torch

from npu_standin.patches import replace

_REAL_DEVICE = torch.device
HOST = {"type": "cpu"}            # set by install()
_local = threading.local()

# torch functions with a `device=` argument (transfer_to_npu's torch_fn_white_list, those that exist).
TORCH_FACTORIES = (
    "logspace", "randint", "hann_window", "rand", "full_like", "ones_like", "rand_like", "randperm",
    "arange", "frombuffer", "normal", "empty_strided", "empty_like", "scalar_tensor", "tril_indices",
    "bartlett_window", "ones", "sparse_coo_tensor", "randn", "kaiser_window", "tensor", "triu_indices",
    "as_tensor", "zeros", "randint_like", "full", "eye", "empty", "blackman_window", "zeros_like",
    "range", "sparse_csr_tensor", "randn_like", "from_file", "linspace", "hamming_window",
    "empty_quantized", "sparse_compressed_tensor", "asarray", "empty_permuted",
)
TENSOR_METHODS = ("new_empty", "new_empty_strided", "new_full", "new_ones", "new_tensor", "new_zeros")
DEVICE_KWARGS = ("device", "device_type", "map_location", "device_id")

_installed = {"done": False}


# ---- mapping --------------------------------------------------------------------------------
def host_type() -> str:
    return HOST["type"]


def current_index() -> int:
    return getattr(_local, "index", 0)


def set_current_index(index: int) -> None:
    _local.index = int(index)


def host_device(index: int | None = None) -> torch.device:
    """The host device an NPU index lands on: the cpu, or cuda:index (the current one by default)."""
    if HOST["type"] == "cpu":
        return _REAL_DEVICE("cpu")
    if index is None:
        index = torch.cuda.current_device()
    return _REAL_DEVICE("cuda", index)


def _npu_index(text: str) -> int | None | bool:
    """None for "npu", N for "npu:N", False for anything else."""
    if text == "npu":
        return None
    if text.startswith("npu:") and text[4:].isdigit():
        return int(text[4:])
    return False


def needs_map(value) -> bool:
    kind = type(value)
    return (kind is str and value.startswith("npu")) or (kind is int)


def map_device(value):
    """An npu spelling (or an integer index) -> the host device; anything else is returned unchanged."""
    kind = type(value)
    if kind is str:
        index = _npu_index(value.strip())
        if index is not False:
            return host_device(index)
        return value
    if kind is int:
        return host_device(value)
    return value


def _map_kwargs(kwargs: dict) -> None:
    for key in DEVICE_KWARGS:
        value = kwargs.get(key)
        if value is not None:
            if key == "device_type":
                if type(value) is str and value.startswith("npu"):
                    kwargs[key] = HOST["type"]
            elif key == "map_location":
                kwargs[key] = _map_location(value)
            elif needs_map(value):
                kwargs[key] = map_device(value)


def _map_location(value):
    if isinstance(value, dict):
        return {k: (str(map_device(v)) if type(v) is str else v) for k, v in value.items()}
    if type(value) is str and value.startswith("npu"):
        return map_device(value)
    return value


# ---- torch.device ---------------------------------------------------------------------------
class _DeviceMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, _REAL_DEVICE)

    def __subclasscheck__(cls, sub):
        return isinstance(sub, type) and issubclass(sub, _REAL_DEVICE)

    def __call__(cls, *args, **kwargs):
        if args and type(args[0]) is str:
            text = args[0].strip()
            index = _npu_index(text)
            if index is not False:
                if index is None:
                    index = args[1] if len(args) > 1 else kwargs.get("index")
                return host_device(index)
        elif not args and type(kwargs.get("type")) is str and kwargs["type"].startswith("npu"):
            index = _npu_index(kwargs["type"])
            return host_device(kwargs.get("index") if index is None else index)
        elif args and type(args[0]) is int and len(args) == 1 and not kwargs:
            return host_device(args[0])
        return _REAL_DEVICE(*args, **kwargs)

    def __getattr__(cls, name):
        return getattr(_REAL_DEVICE, name)

    # The class stands for torch.device in comparisons and type tables too (torch.fx's codegen and
    # dynamo's constant types compare classes with `torch.device`).
    def __eq__(cls, other):
        return other is cls or other is _REAL_DEVICE

    def __ne__(cls, other):
        return not _DeviceMeta.__eq__(cls, other)

    def __hash__(cls):
        return hash(_REAL_DEVICE)


class device(metaclass=_DeviceMeta):  # noqa: N801 - stands for torch.device
    """torch.device under the npu stand-in: "npu" and "npu:N" give the host device."""


# ---- wrappers -------------------------------------------------------------------------------
def _wrap_kwargs(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if kwargs:
            _map_kwargs(kwargs)
        return fn(*args, **kwargs)

    wrapper.__npu_standin_wrapped__ = fn
    return wrapper


def _wrap_first_and_kwargs(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if args and needs_map(args[0]):
            args = (map_device(args[0]), *args[1:])
        if kwargs:
            _map_kwargs(kwargs)
        return fn(self, *args, **kwargs)

    wrapper.__npu_standin_wrapped__ = fn
    return wrapper


def _tensor_npu(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    """Tensor.npu(): the tensor on the stand-in's device (the host device)."""
    if device is None:
        target = host_device(None)
    elif needs_map(device):
        target = map_device(device)
    else:
        target = device          # a torch.device is a host device already
    return self.to(target, non_blocking=non_blocking, memory_format=memory_format)


def _module_npu(self, device=None):
    """nn.Module.npu(): the module on the stand-in's device (the host device)."""
    target = map_device(device) if needs_map(device) else (device if device is not None else host_device(None))
    return self.to(target)


def _is_npu(self) -> bool:
    return self.device.type == HOST["type"]


class _GeneratorMeta(type(torch.Generator)):
    def __instancecheck__(cls, instance):
        return type.__instancecheck__(cls, instance) or isinstance(instance, cls.__mro__[1])


def _generator_proxy():
    real = torch.Generator

    class Generator(real, metaclass=_GeneratorMeta):
        def __new__(cls, device="cpu"):
            return real.__new__(cls, map_device(device) if needs_map(device) else device)

    Generator.__module__ = "torch"
    Generator.__qualname__ = "Generator"
    return Generator


def _wrap_autocast_init(init):
    @functools.wraps(init)
    def wrapper(self, device_type, *args, **kwargs):
        if type(device_type) is str and device_type.startswith("npu"):
            device_type = HOST["type"]
        return init(self, device_type, *args, **kwargs)

    return wrapper


def _wrap_device_type_first(fn):
    def wrapper(*args, **kwargs):
        if args and type(args[0]) is str and args[0].startswith("npu"):
            args = (HOST["type"], *args[1:])
        if type(kwargs.get("device_type")) is str and kwargs["device_type"].startswith("npu"):
            kwargs["device_type"] = HOST["type"]
        return fn(*args, **kwargs)

    wrapper = functools.wraps(fn)(wrapper)
    if fn.__name__.startswith(("is_", "get_")):
        # Autocast state is fixed while a graph is captured: dynamo takes the getter's answer as a
        # constant, as it does the real one's (otherwise "torch.* op returned non-Tensor": no graph;
        # transformers 5.0's rotary embeddings ask torch.is_autocast_enabled(device_type)).
        wrapper._dynamo_marked_constant = True    # torch.compiler.assume_constant_result, without importing dynamo
    return wrapper


def _wrap_get_device_module(fn):
    @functools.wraps(fn)
    def wrapper(device=None):
        if (type(device) is str and device.startswith("npu")):
            return torch.npu
        return fn(device)

    return wrapper


def _wrap_set_default_device(fn):
    @functools.wraps(fn)
    def wrapper(device):
        return fn(map_device(device) if needs_map(device) else device)

    return wrapper


class HostOrderedStream:
    """A stream that is the host's program order (npu_module.HostStream): work is done when a call
    returns, so recording a tensor on it keeps nothing alive (here and in compile's captured regions)."""


def _record_stream(real):
    @functools.wraps(real)
    def record_stream(self, stream):
        if isinstance(stream, HostOrderedStream):
            return None            # every host stream is the program order: nothing to keep alive for
        return real(self, stream)

    return record_stream


def install(host: str) -> None:
    """Make the device type `npu` land on `host` ("cpu" or "cuda") in this process."""
    if _installed["done"]:
        return
    _installed["done"] = True
    HOST["type"] = host
    # `with torch.device(...)` applies to the constructors torch.utils._device lists, cached on first use:
    # fill that cache with the real functions before they are wrapped (transfer_to_npu does the same).
    from torch.utils._device import _device_constructors

    _device_constructors()
    replace(torch, "device", lambda real: device)
    for name in TORCH_FACTORIES:
        if callable(getattr(torch, name, None)):
            replace(torch, name, _wrap_kwargs)
    replace(torch, "load", _wrap_kwargs)
    tensor = torch.Tensor
    replace(tensor, "to", _wrap_first_and_kwargs)
    for name in TENSOR_METHODS:
        replace(tensor, name, _wrap_kwargs)
    replace(tensor, "pin_memory", _wrap_first_and_kwargs)
    replace(tensor, "npu", lambda real: _tensor_npu)
    replace(tensor, "is_npu", lambda real: property(_is_npu))
    replace(tensor, "record_stream", _record_stream)
    module = torch.nn.Module
    replace(module, "to", _wrap_first_and_kwargs)
    replace(module, "to_empty", _wrap_kwargs)
    replace(module, "npu", lambda real: _module_npu)
    replace(torch, "Generator", lambda real: _generator_proxy())
    replace(torch.amp.autocast_mode.autocast, "__init__", _wrap_autocast_init)
    for name in ("is_autocast_enabled", "get_autocast_dtype", "set_autocast_dtype", "set_autocast_enabled"):
        if callable(getattr(torch, name, None)):
            replace(torch, name, _wrap_device_type_first)
    replace(torch, "get_device_module", _wrap_get_device_module)
    replace(torch, "set_default_device", _wrap_set_default_device)
    os.environ.setdefault("NPU_STANDIN_HOST", host)

