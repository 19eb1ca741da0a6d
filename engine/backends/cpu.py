"""The CPU backend: the host's processor and memory (the device memory of a cpu run)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

from engine.backends.base import Backend


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip().lower() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    # aarch64 hosts (Kunpeng servers in Atlas machines) have no "model name" in /proc/cpuinfo;
    # lscpu names the part from its implementer/part tables.
    exe = shutil.which("lscpu")
    if exe:
        try:
            out = subprocess.run([exe], capture_output=True, text=True, timeout=5,
                                 env={**os.environ, "LC_ALL": "C"}).stdout
            for line in out.splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "Model name" and value.strip() and value.strip() != "-":
                    return value.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or None


def mem_total_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                parts = line.split()
                factor = 1024 if len(parts) > 2 and parts[2].lower() == "kb" else 1
                return int(parts[1]) * factor
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


# The host is always usable; its facts (cpu_model, memory) are in every environment record.
BACKEND = Backend("cpu", "CPU", problem=lambda torch: None, hint=lambda problem: "",
                  record=lambda torch, kind, index, env: None)
