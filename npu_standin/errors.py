"""What the stand-in refuses, in one line naming the name and where it was called."""

from __future__ import annotations

import os
import sys

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class StandinError(RuntimeError):
    """Base of the stand-in's own failures."""


class UnsupportedOp(StandinError):
    """A torch_npu / torchair name (or a mode of one) the stand-in has no reference for; raised when
    called, not on attribute access (hasattr() and tables that only name an op keep working)."""


def call_site(skip_torch: bool = True) -> str:
    """file:line of the innermost frame outside the stand-in (and torch's dispatch code)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        internal = path.startswith(_PACKAGE_DIR) or "<frozen" in path
        if skip_torch and (f"{os.sep}torch{os.sep}" in path or f"{os.sep}torch_npu{os.sep}" in path):
            internal = True
        if not internal:
            return f"{_short(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def _short(path: str) -> str:
    cwd = os.getcwd()
    try:
        rel = os.path.relpath(path, cwd)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def unsupported_message(name: str, site: str, what: str = "has no reference kernel") -> str:
    return (f"npu stand-in: {name} {what} (called at {site}); the stand-in runs only what it can "
            "reproduce on the host: run this path on an NPU")


class _Unsupported:
    """A callable placeholder for a torch_npu / torchair name without a reference.

    Accessing it works (module-level tables that merely mention it still import); calling it raises
    UnsupportedOp with the name and the call site, and records the failure."""

    _npu_standin_unsupported = True

    def __init__(self, name: str, what: str = "has no reference kernel"):
        self.__name__ = name.rsplit(".", 1)[-1]
        self.__qualname__ = name
        self._name = name
        self._what = what

    def __call__(self, *args, **kwargs):
        from npu_standin import record

        if record.compiling():
            # traced by dynamo (a ge_graph / npugraph_ex step, fullgraph): it cannot trace the frame walk
            # of call_site (sys._getframe) and would fail with its own "marked as skipped"; raised here
            # instead, the stand-in's line is the cause dynamo reports ("Observed exception").
            raise UnsupportedOp(unsupported_message(self._name, "a captured region (torch.compile)", self._what))
        site = call_site()
        message = unsupported_message(self._name, site, self._what)
        record.unsupported(self._name, site)
        print(f"[npu-standin] error: {message.removeprefix('npu stand-in: ')}", file=sys.stderr, flush=True)
        raise UnsupportedOp(message)

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unsupported(f"{self._name}.{attr}", self._what)

    def __repr__(self):
        return f"<npu stand-in: {self._name} (not provided)>"


def unsupported(name: str, what: str = "has no reference kernel") -> _Unsupported:
    return _Unsupported(name, what)


def is_unsupported(obj) -> bool:
    return bool(getattr(type(obj), "_npu_standin_unsupported", False))
