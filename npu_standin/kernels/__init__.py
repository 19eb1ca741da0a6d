"""Reference kernels: torch_npu ops in plain PyTorch, registered under their own schemas.

Each op is defined in the `npu` torch.library namespace (torchair's in `air`) with the schema the
torch-npu 2.13.0 wheel declares (csrc/aten/npu_native_functions_by_codegen.yaml), implemented for
every backend (CompositeExplicitAutograd) by a Python function that follows torch_npu's documented
semantics (the op-plugin API pages and their "等价计算逻辑" equivalents), with a fake (meta)
implementation for graph capture. `torch.ops.npu.<op>` and `torch_npu.<op>` both reach it; every
call is counted in the process's usage record. What an op's documentation leaves open, or a
quantized mode, is refused with one line (UnsupportedOp), never approximated.

`REFERENCES` is the op table: name -> Reference(schema, formulation, test).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

from npu_standin import record
from npu_standin.errors import UnsupportedOp, call_site


@dataclass
class Reference:
    name: str                  # op name (overload-free), e.g. "npu_rms_norm"
    schema: str                # full schema as torch_npu declares it
    impl: Callable
    fake: Callable | None
    formulation: str           # what the reference computes, in one line
    test: str                  # the unit test that checks it against an independent formulation
    namespace: str = "npu"
    overloads: list = field(default_factory=list)   # extra (schema, impl) pairs
    # In-place ops: the names of the inputs they write, and the schema of a variant returning nothing,
    # which torch.compile can functionalize (a custom op returning an alias of its input cannot be).
    mutates: tuple = ()
    capture_schema: str | None = None


REFERENCES: dict[str, Reference] = {}
_installed = {"done": False}
_libraries: dict[str, torch.library.Library] = {}


def reference(schema: str, *, formulation: str, test: str, namespace: str = "npu", fake: Callable | None = None,
              mutates: tuple = (), capture_schema: str | None = None):
    """Register `impl` as the reference of the op declared by `schema`."""
    name = schema.split("(", 1)[0]

    def decorate(impl):
        key = name if namespace == "npu" else f"{namespace}::{name}"
        REFERENCES[key] = Reference(name, schema, impl, fake, formulation, test, namespace, mutates=mutates,
                                    capture_schema=capture_schema)
        return impl

    return decorate


def overload(base: str, schema: str, impl: Callable, namespace: str = "npu") -> None:
    key = base if namespace == "npu" else f"{namespace}::{base}"
    REFERENCES[key].overloads.append((schema, impl))


def refuse(op: str, what: str) -> None:
    """One line: this use of `op` has no reference (a quantized mode, an undocumented case)."""
    site = call_site()
    record.unsupported(f"{op} ({what})", site)
    message = f"npu stand-in: {op} with {what} has no reference kernel (called at {site}); run this path on an NPU"
    import sys

    print(f"[npu-standin] error: {message.removeprefix('npu stand-in: ')}", file=sys.stderr, flush=True)
    raise UnsupportedOp(message)


def _counted(name: str, impl: Callable) -> Callable:
    @functools.wraps(impl)
    def kernel(*args, **kwargs):
        record.op(name)
        return impl(*args, **kwargs)

    return kernel


def _load_modules() -> None:
    from npu_standin.kernels import (attention, gated_delta_rule, matmul, matmul_all_reduce, mc2, misc, mla,  # noqa: F401
                                     moe, norm, quant, rope)


def install() -> None:
    """Define every reference op in torch.library (once per process)."""
    if _installed["done"]:
        return
    _installed["done"] = True
    _load_modules()
    for ref in REFERENCES.values():
        lib = _libraries.get(ref.namespace)
        if lib is None:
            lib = _libraries[ref.namespace] = torch.library.Library(ref.namespace, "DEF")
        lib.define(ref.schema)
        counted_as = ref.name if ref.namespace == "npu" else f"torchair.ops.{ref.name}"
        lib.impl(ref.name, _counted(counted_as, ref.impl), "CompositeExplicitAutograd")
        if ref.fake is not None:
            torch.library.register_fake(f"{ref.namespace}::{ref.name}", ref.fake, lib=lib)
        if ref.capture_schema:
            variant = ref.capture_schema.split("(", 1)[0]
            lib.define(ref.capture_schema)
            lib.impl(variant, _counted(counted_as, _discard(ref.impl)), "CompositeExplicitAutograd")
            torch.library.register_fake(f"{ref.namespace}::{variant}", _discard(lambda *a, **k: None), lib=lib)
        for schema, impl in ref.overloads:
            overload_name = schema.split("(", 1)[0]
            lib.define(schema)
            lib.impl(overload_name, _counted(ref.name, impl), "CompositeExplicitAutograd")
    _install_op_namespace()


def install_torch_ops() -> None:
    """torch's own ops whose NPU semantics differ from the host's where upstream's recipes meet them
    (matmul / mm / bmm / addmm / F.linear of mixed dtypes: kernels/matmul.py). Activation calls it."""
    from npu_standin.kernels.matmul import install_torch_ops as _matmul

    _matmul()


def _discard(impl: Callable) -> Callable:
    @functools.wraps(impl)
    def kernel(*args, **kwargs):
        impl(*args, **kwargs)

    return kernel


def _inplace_entry(ref: Reference) -> Callable:
    """torch_npu.<in-place op>: the capturable variant, returning the inputs it wrote (as documented)."""
    import inspect

    variant = getattr(torch.ops.npu, ref.capture_schema.split("(", 1)[0])
    signature = inspect.signature(ref.impl)

    @functools.wraps(ref.impl)
    def entry(*args, **kwargs):
        variant(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        written = tuple(bound.arguments[name] for name in ref.mutates)
        return written[0] if len(written) == 1 else written

    entry.__name__ = ref.name
    return entry


_entries: dict[str, Callable] = {}


def has_reference(op: str) -> bool:
    _load_modules()
    return op in REFERENCES or f"air::{op}" in REFERENCES


def op_callable(name: str):
    """torch_npu.<name>: the registered op (an OpOverloadPacket), or None."""
    ref = REFERENCES.get(name)
    if ref is None:
        return None
    if ref.capture_schema:
        if name not in _entries:
            _entries[name] = _inplace_entry(ref)
        return _entries[name]
    return getattr(torch.ops.npu, name)


def _install_op_namespace() -> None:
    """torch.ops.npu.<unknown op>: a placeholder that fails with one line when called."""
    from torch._ops import _OpNamespace

    from npu_standin.errors import unsupported

    class StandinNamespace(_OpNamespace):
        __module__ = _OpNamespace.__module__      # ops are found (pickled, cached) as torch's own

        def __getattr__(self, op_name):
            try:
                return super().__getattr__(op_name)
            except AttributeError:
                if op_name.startswith("__"):
                    raise
                return unsupported(f"torch.ops.{self.name}.{op_name}")

    from npu_standin.patches import replace

    for ns in ("npu", "air"):
        replace(torch.ops, ns, lambda real, ns=ns: StandinNamespace(ns), name=f"torch.ops.{ns}")


def table() -> list[dict]:
    """The op table: one row per reference (op, schema, formulation, test)."""
    _load_modules()
    rows = []
    for key, ref in sorted(REFERENCES.items()):
        rows.append({"op": key if ref.namespace == "npu" else f"torchair.ops.{ref.name}",
                     "schema": ref.schema, "reference": ref.formulation, "test": ref.test})
    return rows


def table_markdown() -> str:
    """docs/standin.md's table of the reference kernels (tests/lint/test_readme.py checks the page
    against it, so the list there is the registered one)."""
    rows = ["| op | what the reference computes | its test |", "|---|---|---|"]
    for row in table():
        cells = (f"`{row['op']}`", row["reference"], f"`{row['test']}`")
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows)
