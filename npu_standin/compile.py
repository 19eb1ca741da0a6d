"""Graph mode under the stand-in: torchair's GE backend and npugraph_ex are torch.compile backends.

The model is captured by torch.compile (dynamo) exactly as torchair captures it on an NPU, so a graph
break that `fullgraph=True` refuses there is refused here too. The captured graph is then compiled by
inductor where the host can (a C++ compiler for the cpu, triton for cuda) and run as captured
(eagerly) otherwise or when inductor fails. NPU_STANDIN_COMPILE picks: auto (default), inductor,
capture, or off (no torch.compile at all: the function runs eagerly). Every compile of a function
after its first is a recompile and is reported (one line) with its count.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import types

import torch

from npu_standin import record

MODES = ("auto", "inductor", "capture", "off")
_real_compile = torch.compile


def requested_mode() -> str:
    mode = os.environ.get("NPU_STANDIN_COMPILE", "auto")
    return mode if mode in MODES else "auto"


def host_can_compile() -> bool:
    from npu_standin import device as _dev

    if _dev.host_type() == "cuda":
        return importlib.util.find_spec("triton") is not None
    return any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++"))


def resolved_mode() -> str:
    mode = requested_mode()
    if mode == "auto":
        return "inductor" if host_can_compile() else "capture"
    return mode


def _label(fn) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    owner = getattr(fn, "__self__", None)
    if owner is not None and "." not in name:
        name = f"{type(owner).__name__}.{name}"
    return name


# What reads a device value back to the host inside a captured graph (a scalar, a list, a copy, or an
# output whose shape depends on the data): on an NPU each stops the stream until the device is done.
# dynamo keeps them in the graph only where it is told to (capture_scalar_outputs,
# capture_dynamic_output_shape_ops); otherwise they are graph breaks, which fullgraph refuses.
HOST_SYNC_METHODS = frozenset({"item", "tolist", "cpu", "numpy", "nonzero"})


def _host_sync_functions() -> frozenset:
    aten = torch.ops.aten
    return frozenset({torch.nonzero, torch.masked_select, torch.unique, torch.Tensor.item, torch.Tensor.tolist,
                      aten._local_scalar_dense.default, aten.item.default, aten.nonzero.default,
                      aten.masked_select.default})


_STANDIN_DIR = os.path.dirname(os.path.realpath(__file__)) + os.sep
_FRAME = re.compile(r'^\s*File "([^"]+)", line \d+')


def _frames(node) -> list[tuple[str, str]]:
    """(file, the frame's line) of each frame dynamo recorded for the node, outermost first."""
    found = (_FRAME.match(line) for line in (node.meta.get("stack_trace") or "").splitlines())
    return [(frame.group(1), frame.string.strip()) for frame in found if frame]


def _in_standin(frames: list[tuple[str, str]]) -> bool:
    """Whether the node was traced inside the stand-in's own code (a reference kernel reading its list
    arguments, say): on an NPU that is one kernel taking host values, not the model's read-back."""
    return any(os.path.realpath(path).startswith(_STANDIN_DIR) for path, _ in frames)


def _host_scalar(node) -> bool:
    """A graph input that was a Python number (a module's eps or scale under dynamic=True): dynamo passes
    it as a 0-d tensor and reads it back with .item(), a host value, never on the device."""
    return node.op == "placeholder" and bool(getattr(node.meta.get("grapharg"), "pass_arg_as_tensor", False))


def host_syncs(gm) -> list[str]:
    """The nodes of a captured graph, outside the stand-in's reference kernels, that read a device value
    back to the host."""
    functions = _host_sync_functions()
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target == "item" and node.args and _host_scalar(node.args[0]):
            continue
        if node.op == "call_method" and node.target in HOST_SYNC_METHODS:
            name = f"Tensor.{node.target}"
        elif node.op == "call_function" and node.target in functions:
            name = getattr(node.target, "__name__", str(node.target))
        else:
            continue
        frames = _frames(node)
        if not _in_standin(frames):
            found.append(f"{name} at {frames[-1][1]}" if frames else name)
    return found


class StandinBackend:
    """A dynamo backend standing for torchair's npu backend ("ge_graph") or "npugraph_ex"."""

    def __init__(self, kind: str, label: str | None = None, config=None, fullgraph: bool | None = None):
        self.kind = kind
        self.label = f"{label} [{kind}]" if label else kind
        self.config = config
        self.fullgraph = fullgraph
        self.calls = 0

    def for_target(self, fn, fullgraph: bool | None = None) -> "StandinBackend":
        return StandinBackend(self.kind, _label(fn), self.config, fullgraph)

    @property
    def target(self) -> str:
        return self.label.rsplit(" [", 1)[0]

    def __call__(self, gm, example_inputs, **kwargs):
        mode = resolved_mode()
        compiled, failed = gm.forward, None
        if mode == "inductor":
            from torch._dynamo.exc import RestartAnalysis
            from torch._inductor.compile_fx import compile_fx

            try:
                compiled = compile_fx(gm, example_inputs)
            except RestartAnalysis:
                # not a compile: dynamo's signal to trace again (TensorifyScalarRestartAnalysis: a Python float
                # inductor does not take as a graph input is specialised) and call the backend with that graph.
                # Swallowed, the first graph ran with the float unspecialised, its guard failing at each new
                # value: a recompile per decode step, until the recompile limit fails the fullgraph capture.
                raise
            except Exception as exc:  # noqa: BLE001 - the host cannot compile: run what was captured
                failed = exc
        self.calls += 1
        syncs = host_syncs(gm)
        # per compile: whether the capture was whole (a graph break is refused, not split) and what in
        # it reads back to the host; summed over compiles and the ranks' processes
        record.compile_event(self.label, backend=self.kind, mode=mode, compiles=1,
                             recompiles=1 if self.calls > 1 else 0, fullgraph=bool(self.fullgraph),
                             host_syncs=len(syncs))
        if syncs:
            record.note(f"host-sync:{self.label}", f"{self.label}: {len(syncs)} host sync(s) in the captured graph "
                                                    f"({', '.join(sorted(set(syncs)))}): each stops the NPU stream")
        if self.calls > 1:
            record.note(f"recompile:{self.label}:{self.calls}",
                        f"{self.label} recompiled ({self.kind} -> torch.compile/{mode}), recompile "
                        f"{self.calls - 1}: a guard on its inputs failed (changed shapes, Python values)")
        if failed is not None:
            record.compile_event(self.label, eager_fallback=f"{type(failed).__name__}: {str(failed)[:200]}")
            record.note(f"inductor-failed:{self.label}",
                        f"{self.label}: inductor failed on this host ({type(failed).__name__}); "
                        "the captured graph runs eagerly")
        return compiled


def compile(model=None, *, fullgraph: bool = False, dynamic=None, backend="inductor", mode=None,  # noqa: A001
            options=None, disable: bool = False):
    """torch.compile, with the NPU backends ("npugraph_ex", torchair's) standing on the host."""
    if model is None:
        return lambda fn: compile(fn, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode,
                                  options=options, disable=disable)
    if backend == "npugraph_ex":
        backend = StandinBackend("npugraph_ex")
    if not isinstance(backend, StandinBackend):
        return _real_compile(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode,
                             options=options, disable=disable)
    backend = backend.for_target(model, fullgraph)
    if resolved_mode() == "off" or disable:
        record.compile_event(backend.label, backend=backend.kind, mode="off")
        record.note(f"compile-off:{backend.label}", f"{backend.label}: not compiled (NPU_STANDIN_COMPILE=off); "
                                                    "runs eagerly")
        return model
    return _real_compile(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, disable=disable)


def cache_compile(kind: str):
    def cache_compile(func, *, cache_dir=None, config=None, dynamic=False, fullgraph=True, ge_cache=False,
                      options=None, **kwargs):
        record.note(f"cache-compile:{kind}", f"{kind} cache_compile: no compile cache on the stand-in "
                                             "(compiled in-process each run)", echo=False)
        return compile(func, fullgraph=True, dynamic=dynamic, backend=StandinBackend(kind, config=config))

    return cache_compile


def npugraph_ex_module() -> types.ModuleType:
    module = types.ModuleType("torch.npu.npugraph_ex")
    module.inference = types.SimpleNamespace(cache_compile=cache_compile("npugraph_ex"))
    module.compile = functools.partial(compile, backend="npugraph_ex")
    return module


def get_npu_backend(*, compiler_config=None, custom_decompositions=None, **kwargs) -> StandinBackend:
    record.runtime("torchair.get_npu_backend")
    return StandinBackend("ge_graph", config=compiler_config)


_installed = {"done": False}


def _trace_host_record_stream() -> None:
    """`tensor.record_stream(torch.npu.Stream())` inside a captured region: dynamo takes only torch.Stream
    objects there, and a host stream (program order, device.HostOrderedStream) is a Python object; as in
    eager (device._record_stream), recording on it keeps nothing alive, so it traces to nothing."""
    from torch._dynamo.variables.constant import ConstantVariable
    from torch._dynamo.variables.tensor import TensorVariable

    from npu_standin.device import HostOrderedStream

    real = TensorVariable.method_record_stream

    def method_record_stream(self, tx, stream):
        if isinstance(getattr(stream, "value", None), HostOrderedStream):
            record.note("captured-record-stream", "record_stream on a host stream in a captured graph: nothing "
                                                  "to keep alive (host program order)", echo=False)
            return ConstantVariable.create(None)
        return real(self, tx, stream)

    TensorVariable.method_record_stream = method_record_stream


class _WithReplacedObjects:
    """One of dynamo's lazily built tables of torch objects (trace_rules.get_torch_obj_rule_map,
    get_tensor_method), also naming the real objects the stand-in replaced: `extend(table)`."""

    def __init__(self, build, extend):
        self.build = build
        self.extend = extend
        self.value = None
        functools.update_wrapper(self, build)

    def __call__(self):
        if self.value is None:
            self.value = self.extend(self.build())
        return self.value

    def cache_clear(self) -> None:       # init_process_group clears dynamo's tables (trace_rules.clear_lru_cache)
        self.build.cache_clear()
        self.value = None


def _trace_replaced_callables() -> None:
    """dynamo builds its tables of torch objects by name the first time it traces, after the stand-in
    replaced some of them (patches.PATCHED): the tables name the stand-in's replacement, not torch's
    callable it closes over. A replacement that dynamo inlines (a Tensor method, F.linear, a function
    whose rule is to inline it, like torch.set_default_device) then reaches torch's own callable, which no
    table names: "Attempted to call function marked as skipped". So each real callable gets the rule its
    name has (the replacement's), and a replaced Tensor method stays a Tensor method, as without the
    stand-in."""
    import types as _types

    from torch._dynamo import trace_rules
    from torch._dynamo.utils import hashable

    from npu_standin.patches import PATCHED

    def with_reals(rules: dict) -> dict:
        for patch in PATCHED.values():
            if not (hashable(patch.replacement) and hashable(patch.real)):
                continue
            rule = rules.get(patch.replacement)
            if rule is not None and patch.real is not None and patch.real not in rules:
                rules[patch.real] = rule
        return rules

    descriptors = (_types.MethodDescriptorType, _types.WrapperDescriptorType, _types.BuiltinFunctionType)

    def with_real_methods(methods: frozenset) -> frozenset:
        return methods | {patch.real for patch in PATCHED.values()
                          if patch.name.startswith("torch.Tensor.") and isinstance(patch.real, descriptors)}

    if not isinstance(trace_rules.get_torch_obj_rule_map, _WithReplacedObjects):
        trace_rules.get_torch_obj_rule_map = _WithReplacedObjects(trace_rules.get_torch_obj_rule_map, with_reals)
        trace_rules.get_tensor_method = _WithReplacedObjects(trace_rules.get_tensor_method, with_real_methods)


def install() -> None:
    if _installed["done"]:
        return
    _installed["done"] = True
    from npu_standin.patches import replace

    replace(torch, "compile", lambda real: compile)
    record.compiling = torch.compiler.is_compiling
    _trace_host_record_stream()
    _trace_replaced_callables()

