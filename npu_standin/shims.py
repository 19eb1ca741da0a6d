"""The `torch_npu` and `torchair` modules the stand-in serves (built on import, after activation).

Names the stand-in provides resolve; a torch_npu kernel without a reference resolves to a
placeholder that fails with one line when called (so tables that merely name it still import); any
other missing name is an AttributeError / ImportError saying it is not provided.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch

from npu_standin import record
from npu_standin.errors import call_site, unsupported

# torch_npu's own dtype codes (torch_npu/op_plugin/meta/_meta_registrations.py: TORCH_NPU_DTYPE_TO_STRING_MAP
# and TORCH_DTYPE_ENUM_VALUE_TO_SCALAR_TYPE_MAP): ints that quantized kernels take as dtype arguments.
NPU_DTYPE_CODES = {"int4": 285, "hifloat8": 290, "float8_e5m2": 291, "float8_e4m3fn": 292, "float8_e8m0fnu": 293,
                   "float4_e2m1fn_x2": 296, "float4_e1m2fn_x2": 297}


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"npu stand-in: {self.__name__}.{name} is not provided (used at {call_site()})")


class _TorchNpu(_Module):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        from npu_standin import kernels

        op = kernels.op_callable(name)
        if op is not None:
            return op
        if name.startswith(("npu_", "_npu_")) or name in ("scatter_update", "scatter_update_"):
            return unsupported(f"torch_npu.{name}")
        return super().__getattr__(name)


def _module(name: str, cls=_Module, doc: str | None = None, **attrs) -> types.ModuleType:
    module = cls(name, doc)
    module.__npu_standin__ = True
    module.__path__ = []          # a package: submodules go through the stand-in's finder
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def _version() -> str:
    base = torch.__version__.split("+", 1)[0]
    return f"{base}+npu.standin"


def empty_with_swapped_memory(size, *, dtype=None, device=None):
    """torch_npu.empty_with_swapped_memory: NPU memory backed by host memory; on the stand-in, host memory."""
    from npu_standin import device as _dev

    record.runtime("torch_npu.empty_with_swapped_memory")
    return torch.empty(size, dtype=dtype, device=_dev.map_device(device) if _dev.needs_map(device) else device)


def build_torch_npu() -> dict[str, types.ModuleType]:
    from npu_standin import dist, kernels, npu_module, profiler
    from npu_standin.kernels.misc import get_npu_format

    kernels.install()
    npu = npu_module.install()
    c10d = dist.c10d_module()
    c_module = _module("torch_npu._C", _distributed_c10d=c10d)
    prof = profiler.build()
    distributed = _module("torch_npu.distributed", is_hccl_available=lambda: True)
    root = _module("torch_npu", _TorchNpu, "torch_npu under the npu stand-in: the npu device lands on the host "
                   "device and torch_npu kernels are reference implementations (never an NPU)",
                   npu=npu, _C=c_module, profiler=prof, distributed=distributed,
                   contrib=_module("torch_npu.contrib"), utils=_module("torch_npu.utils"),
                   __version__=_version(), version=types.SimpleNamespace(__version__=_version()),
                   get_npu_format=get_npu_format, empty_with_swapped_memory=empty_with_swapped_memory,
                   set_device=npu.set_device, **NPU_DTYPE_CODES)
    modules = {"torch_npu": root, "torch_npu.npu": npu, "torch_npu._C": c_module,
               "torch_npu._C._distributed_c10d": c10d, "torch_npu.profiler": prof,
               "torch_npu.distributed": distributed, "torch_npu.contrib": root.contrib, "torch_npu.utils": root.utils}
    return modules


# ---- torchair --------------------------------------------------------------------------------
class _Options:
    """A permissive settings tree (CompilerConfig and its sections): values are kept, not used."""

    def __init__(self, path: str):
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_values", {})

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        values = object.__getattribute__(self, "_values")
        if name not in values:
            values[name] = _Options(f"{object.__getattribute__(self, '_path')}.{name}")
        return values[name]

    def __setattr__(self, name, value):
        object.__getattribute__(self, "_values")[name] = value

    def as_dict(self) -> dict:
        out = {}
        for key, value in object.__getattribute__(self, "_values").items():
            out[key] = value.as_dict() if isinstance(value, _Options) else value
        return out

    def __repr__(self):
        return f"<{object.__getattribute__(self, '_path')} (npu stand-in) {self.as_dict()}>"


class CompilerConfig(_Options):
    def __init__(self):
        super().__init__("CompilerConfig")


@contextlib.contextmanager
def _no_op_scope(*args, **kwargs):
    yield


def npu_wait_tensor(self, dependency):
    """In a GE graph: order `self` after `dependency`. The host already runs in program order."""
    return self


def _tagged_event_record(event):
    event.record()


def _tagged_event_wait(event):
    event.wait()


def _record_tagged_stream(tensor, tag):
    return None


def _create_tagged_event(tag):
    return torch.npu.Event()


def patch_for_hcom():
    record.runtime("torchair.patch_for_hcom")
    return None


def build_torchair() -> dict[str, types.ModuleType]:
    from npu_standin import compile as _compile
    from npu_standin import kernels

    kernels.install()
    compiler_config = _module("torchair.configs.compiler_config", CompilerConfig=CompilerConfig)
    configs = _module("torchair.configs", compiler_config=compiler_config)
    scope = _module("torchair.scope", npu_stream_switch=_no_op_scope, npu_wait_tensor=npu_wait_tensor,
                    super_kernel=_no_op_scope, limit_core_num=_no_op_scope, op_never_timeout=_no_op_scope)
    ops = _module(
        "torchair.ops",
        npu_fused_infer_attention_score_v2=torch.ops.air.npu_fused_infer_attention_score_v2,
        npu_fused_infer_attention_score=torch.ops.air.npu_fused_infer_attention_score,
        npu_tagged_event_record=_tagged_event_record, npu_tagged_event_wait=_tagged_event_wait,
        npu_record_tagged_stream=_record_tagged_stream, npu_create_tagged_event=_create_tagged_event)
    inference = _module("torchair.inference", cache_compile=_compile.cache_compile("ge_graph"))
    experimental = _module("torchair.ge_concrete_graph.ge_converter.experimental")
    hcom = _module("torchair.ge_concrete_graph.ge_converter.experimental.patch_for_hcom_allreduce")
    experimental.patch_for_hcom_allreduce = hcom
    converter = _module("torchair.ge_concrete_graph.ge_converter", experimental=experimental)
    ge_graph = _module("torchair.ge_concrete_graph", ge_converter=converter)
    root = _module("torchair", doc="torchair under the npu stand-in: graph mode is torch.compile on the host",
                   configs=configs, scope=scope, ops=ops, inference=inference, ge_concrete_graph=ge_graph,
                   CompilerConfig=CompilerConfig, get_npu_backend=_compile.get_npu_backend,
                   patch_for_hcom=patch_for_hcom, __version__=_version())
    return {m.__name__: m for m in (root, configs, compiler_config, scope, ops, inference, ge_graph, converter,
                                   experimental, hcom)}


def build_npugraph_ex() -> dict:
    """`import npugraph_ex` (the package behind torch.npu.npugraph_ex): the same compile entry points."""
    from npu_standin import compile as _compile

    return {"npugraph_ex": _compile.npugraph_ex_module()}


BUILDERS = {"torch_npu": build_torch_npu, "torchair": build_torchair, "npugraph_ex": build_npugraph_ex}
_built: dict[str, types.ModuleType] = {}


def module_for(fullname: str) -> types.ModuleType | None:
    top = fullname.split(".", 1)[0]
    if top not in BUILDERS:
        return None
    if not any(name == top for name in _built):
        _built.update(BUILDERS[top]())
    return _built.get(fullname)


def not_provided(fullname: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(f"npu stand-in: {fullname} is not provided (the stand-in serves torch_npu, "
                               "torch_npu.npu, torch_npu.profiler, torch_npu._C._distributed_c10d, torchair's "
                               "compile, scope and ops, and npugraph_ex)", name=fullname)
