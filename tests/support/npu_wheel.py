"""The real torch-npu wheel of torch's release, pip-installed once into a cache (tests of the
"torch_npu installed without CANN" state)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def torch_npu_wheel(download: bool = True) -> tuple[Path | None, str]:
    """(folder, "") with the real torch-npu wheel of torch's release pip-installed with --no-deps
    --target into a cache dir reused across runs (~44 MB wheel, ~150 MB unpacked, about 7 s), or
    (None, why not). Without CANN its import fails for real (libhccl.so)."""
    import platform
    import shutil
    from importlib.metadata import version

    if sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
        return None, "torch-npu wheels exist for Linux x86_64/aarch64 only"
    release = version("torch").split("+", 1)[0]
    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    target = cache_root / "infer-migrator" / f"torch-npu-{release}-py{sys.version_info[0]}{sys.version_info[1]}"
    if (target / ".complete").exists():
        return target, ""
    if not download:
        return None, f"torch-npu=={release} is not in {target.parent}"
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input", "--quiet",
           "--disable-pip-version-check", "--timeout", "30", "--target", str(tmp), f"torch-npu=={release}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return None, f"could not pip install torch-npu=={release}: {exc}"
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        return None, f"pip cannot install torch-npu=={release} (package index unreachable or no such release): {tail}"
    (tmp / ".complete").write_text(release + "\n")
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(target)
    except OSError:             # another worker got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return target, ""
