"""Which host, boot and pid namespace this process runs in: what a pid recorded elsewhere means only there."""

from __future__ import annotations

import os
from pathlib import Path


def pid_namespace() -> str | None:
    """The pid namespace whose pids this process sees in /proc (psutil's view), as `<boot id>:<namespace
    inode>`: no two hosts, boots or namespaces share one. None where it cannot be told (no /proc, or a /proc
    mounted for another namespace than this process's)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        inode = os.stat("/proc/self/ns/pid").st_ino
        if os.readlink("/proc/self") != str(os.getpid()):
            return None
    except (OSError, ValueError):
        return None
    return f"{boot}:{inode}" if boot else None
