"""Which machine a recipe actually runs on: NPU, CUDA or CPU, and what software it has.

Principle: never pretend to be on an NPU. `detect_environment()` records the device that is
really used, and every NPU fact (npu-smi, CANN, torch_npu) is reported as found, including the
common broken state "torch_npu present, CANN runtime not found".

This module is the public face; each backend is a module of engine/backends/ (npu.py: npu-smi,
CANN, torch_npu and the guarded `import_torch()`; cuda.py; cpu.py). Nothing here imports torch
or torch_npu at module import time.
"""

from __future__ import annotations

import os
import re
from typing import Any, TypedDict

from engine.backends import cpu, cuda, npu
from engine.backends.common import dist_version
from engine.backends.npu import (  # noqa: F401  (public names of this module)
    AUTOLOAD_ENV,
    STATUS_IMPORT_FAILED,
    STATUS_NO_CANN,
    STATUS_NOT_INSTALLED,
    STATUS_OK,
    TorchImportError,
    detect_cann_version,
    detect_npu,
    import_torch,
    parse_npu_smi,
    probe_torch_npu,
    torch_npu_installed,
    torch_pair_ok,
)

# Every device --device can name, in the order `auto` tries them (engine/backends/base.py).
BACKENDS = {backend.name: backend for backend in (npu.BACKEND, cuda.BACKEND, cpu.BACKEND)}


class DeviceUnavailableError(RuntimeError):
    """The requested device cannot be used here; the message is one line naming the problem."""


# ---------------------------------------------------------------------------------------------
# device selection
# ---------------------------------------------------------------------------------------------

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|npu)(?::(\d+))?$")


def _parse_device(spec: Any) -> tuple[str, int | None]:
    text = str(spec if spec is not None else "auto").strip().lower()
    m = _DEVICE_RE.match(text)
    if not m or (m.group(1) in ("auto",) and m.group(2) is not None):
        raise ValueError(f"unknown device {spec!r}: use auto, cpu, cuda[:N] or npu[:N]")
    return m.group(1), int(m.group(2)) if m.group(2) is not None else None


def select_device(preferred: str = "auto"):
    """The torch.device to run on.

    auto: npu when torch_npu imports and sees an NPU, else cuda when available, else cpu.
    "npu", "npu:N", "cuda", "cuda:N": that device, or DeviceUnavailableError with a one-line
    message naming the problem. "cpu" always works.
    """
    kind, index = _parse_device(preferred)
    try:
        torch = import_torch()
    except TorchImportError as exc:
        raise DeviceUnavailableError(
            f"--device {preferred} requested but import torch failed ({exc}); "
            f"set {AUTOLOAD_ENV}=0 or fix the torch install") from exc
    if kind == "auto":
        backend = next(b for b in BACKENDS.values() if b.problem(torch) is None)
        devices = backend.module(torch)
        return torch.device(backend.name, devices.current_device()) if devices is not None else torch.device("cpu")
    backend = BACKENDS[kind]
    problem = backend.problem(torch)
    if problem is not None:
        raise DeviceUnavailableError(f"--device {preferred} requested but {problem}; {backend.hint(problem)}")
    devices = backend.module(torch)
    if devices is None:
        return torch.device("cpu")
    count = devices.device_count()
    if index is not None and index >= count:
        raise DeviceUnavailableError(
            f"--device {preferred} requested but only {count} {backend.label} device(s) are visible; "
            f"use {kind}:0..{kind}:{count - 1}")
    return torch.device(kind, index if index is not None else devices.current_device())


def device_module(kind: str):
    """torch.npu / torch.cuda for a device type; None on the CPU."""
    return BACKENDS[kind].module(import_torch())


def synchronize(device) -> None:
    """Wait for the device's queued work: torch.npu / torch.cuda synchronize; no-op on cpu."""
    devices = device_module(device.type if hasattr(device, "type") else _parse_device(device)[0])
    if devices is not None:
        devices.synchronize(device)


# ---------------------------------------------------------------------------------------------
# the environment record
# ---------------------------------------------------------------------------------------------


class Environment(TypedDict, total=False):
    """What `detect_environment` records: the device really used and the software found."""
    device: str                       # npu | cuda | cpu
    npu_model: str | None
    num_cards: int | None
    num_chips: int | None
    npu_chip_memory_bytes: int | None  # one chip's memory as npu-smi reports it (works without torch_npu)
    cann_version: str | None
    pytorch_version: str | None
    torch_npu_version: str | None
    torch_npu_status: str             # STATUS_OK, STATUS_NO_CANN, ...
    torch_pair_ok: bool | None        # torch and torch_npu versions match
    cuda_device_name: str | None
    cuda_memory_bytes: int | None
    cpu_model: str | None
    cpu_count: int | None
    memory_bytes: int | None
    device_memory_bytes: int | None   # one card's memory (the host's on cpu)
    torch_import_error: str


def detect_environment(device: str = "auto") -> Environment:
    """A JSON-serialisable record of the environment actually used.

    `device` is what the run asked for ("auto", "cpu", "npu", "npu:1", "cuda", ...); the
    recorded "device" is what `select_device(device)` gives, so a run that asks for an NPU it
    cannot have raises DeviceUnavailableError rather than being recorded as an NPU run.
    """
    npu_smi = detect_npu()
    probe = probe_torch_npu()
    try:
        torch = import_torch()
        torch_error = None
    except TorchImportError as exc:
        torch, torch_error = None, str(exc)
    pytorch_version = torch.__version__ if torch is not None else dist_version("torch")

    if torch is not None:
        dev = select_device(device)
        kind, index = dev.type, dev.index
    else:
        kind, index = "cpu", None
        if _parse_device(device)[0] not in ("auto", "cpu"):
            raise DeviceUnavailableError(
                f"--device {device} requested but import torch failed ({torch_error}); "
                f"set {AUTOLOAD_ENV}=0 or fix the torch install")

    memory_bytes = cpu.mem_total_bytes()
    env: Environment = {
        "device": kind,
        "npu_model": npu_smi["npu_model"],
        "num_cards": npu_smi["num_cards"],
        "num_chips": npu_smi["num_chips"],
        "npu_chip_memory_bytes": npu_smi["chip_memory_bytes"],
        "cann_version": detect_cann_version(),
        "pytorch_version": pytorch_version,
        "torch_npu_version": probe["version"],
        "torch_npu_status": probe["status"],
        "torch_pair_ok": torch_pair_ok(pytorch_version, probe["version"]),
        "cuda_device_name": None,
        "cuda_memory_bytes": None,
        "cpu_model": cpu.cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": memory_bytes,
        "device_memory_bytes": memory_bytes if kind == "cpu" else None,
    }
    if torch_error:
        env["torch_import_error"] = torch_error
    if torch is not None:
        for backend in BACKENDS.values():
            backend.record(torch, kind, index, env)
    return env


def simulated_card_bytes(environ=None) -> int | None:
    """MIGRATOR_DEVICE_MEMORY_BYTES (tests and CPU only): the size of a simulated card in bytes —
    a positive integer, optionally with a K/M/G/T suffix (powers of 1024: 8G, 512MiB). Unset or
    empty: None. Anything else is a ValueError with one line that says what is accepted."""
    raw = (os.environ if environ is None else environ).get("MIGRATOR_DEVICE_MEMORY_BYTES", "")
    text = raw.strip()
    if not text:
        return None
    found = re.fullmatch(r"([0-9]{1,20})\s*(?:([KMGT])(?:i?B)?|B)?", text, re.I)
    value = int(found.group(1)) * 1024 ** " KMGT".index(found.group(2).upper() if found.group(2) else " ") \
        if found else 0
    if value <= 0:
        raise ValueError(f"MIGRATOR_DEVICE_MEMORY_BYTES={raw!r} is not a size of a card: give a positive number of "
                         "bytes (e.g. 8589934592 or 8G), or unset it")
    return value
