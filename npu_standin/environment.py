"""The environment a command runs in under the stand-in, and whether a stand-in run is possible.

Nothing here imports torch: a launcher builds the environment, the command's own processes activate
the stand-in (sitecustomize.py in `pythonpath_dir()`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from npu_standin.engine_files import safe_load

loads_json = safe_load.loads_json

DEVICES = ("cpu", "cuda")

ENV_DEVICE = "NPU_STANDIN"                 # cpu | cuda: the stand-in is active in this process tree
ENV_HOME = "NPU_STANDIN_HOME"              # the npu_standin package folder the processes load
ENV_RECORD_DIR = "NPU_STANDIN_RECORD_DIR"  # where each process writes standin-<pid>.json
ENV_MASTER_ADDR = "NPU_STANDIN_MASTER_ADDR"
ENV_MASTER_PORT = "NPU_STANDIN_MASTER_PORT"
ENV_KEEP = "NPU_STANDIN_KEEP"              # folders the rm guard keeps (os.pathsep separated)
ENV_OUTER_PATH = "NPU_STANDIN_OUTER_PATH"  # PATH as the command was given it, before the stand-in's entries

# Folders upstream's launch scripts delete on an NPU host that the stand-in keeps: set_env.sh
# removes the ATC compile cache (/root/atc_data/) on every launch.
KEEP_PATHS = ("/root/atc_data",)


def package_dir() -> Path:
    return Path(__file__).resolve().parent


def pythonpath_dir() -> Path:
    """The folder put first on PYTHONPATH: sitecustomize.py only (it installs the import hooks)."""
    return package_dir() / "_pythonpath"


GUARDS = ("pgrep", "rm", "taskset")


def bin_dir() -> Path:
    """The folder put first on PATH: guards for upstream's launch scripts (pgrep, rm, taskset).

    An install that lost their executable bits (some wheel tools do) gets executable copies in a
    private temporary folder instead."""
    folder = package_dir() / "_bin"
    if all(os.access(folder / name, os.X_OK) for name in GUARDS):
        return folder
    import shutil
    import tempfile

    copy = Path(tempfile.gettempdir()) / f"npu-standin-bin-{os.getuid() if hasattr(os, 'getuid') else 0}"
    copy.mkdir(mode=0o700, exist_ok=True)
    for name in GUARDS:
        target = copy / name
        shutil.copyfile(folder / name, target)
        target.chmod(0o755)
    return copy


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def standin_env(device: str = "cpu", base: dict | None = None, record_dir: str | os.PathLike | None = None,
                master_port: int | None = None) -> dict:
    """The environment of a command run under the stand-in on `device` (cpu or cuda).

    Start from `base` (default: os.environ). Every Python process started with it (torchrun
    ranks, `python3` in shell scripts) activates the stand-in; `python3` resolves to this
    interpreter; upstream's launch-script guards are handled (see `_bin/`)."""
    if device not in DEVICES:
        raise ValueError(f"unknown stand-in device {device!r}: use one of {', '.join(DEVICES)}")
    env = dict(os.environ if base is None else base)
    env[ENV_DEVICE] = device
    env[ENV_HOME] = str(package_dir())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath_dir()), env.get("PYTHONPATH")]))
    env.setdefault(ENV_OUTER_PATH, env.get("PATH") or "")    # the outermost stand-in's: the user's own PATH
    path_entries = [str(bin_dir()), os.path.dirname(os.path.abspath(sys.executable))]
    env["PATH"] = os.pathsep.join(dict.fromkeys(path_entries + (env.get("PATH") or "").split(os.pathsep)))
    # A real but broken torch_npu (no CANN) must not be auto-loaded by `import torch`.
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    # Ranks on one host meet on loopback, on a port of this run's own; the ranks' interface is chosen when
    # they meet (npu_standin/dist.py: loopback on one host, the route to MASTER_ADDR across hosts).
    env[ENV_MASTER_ADDR] = "127.0.0.1"
    env[ENV_MASTER_PORT] = str(master_port or free_port())
    env[ENV_KEEP] = os.pathsep.join(KEEP_PATHS)
    if record_dir is not None:
        env[ENV_RECORD_DIR] = str(record_dir)
    return env


def launcher_path(env=None) -> str | None:
    """The PATH the user's launcher environment has: inside a stand-in run the one the command was given
    (its `python3`, not the stand-in's interpreter put first), else PATH."""
    env = os.environ if env is None else env
    if is_active(env) and ENV_OUTER_PATH in env:
        return env[ENV_OUTER_PATH]
    return env.get("PATH")


def loopback_name() -> str:
    try:
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    except OSError:
        pass
    return "lo"


def is_active(env=os.environ) -> bool:
    return env.get(ENV_DEVICE) in DEVICES


# ---- a real torch_npu ------------------------------------------------------------------------
def probe_real_torch_npu(python: str | None = None, timeout: float | None = None) -> dict:
    """What a real torch_npu does here, tried in a subprocess without the stand-in.

    {"status": "absent" | "broken" | "no-device" | "working", "devices": int, "detail": str}.
    Only "working" (it imports and sees at least one NPU) stops a stand-in run: the stand-in never
    shadows a working torch_npu. Skipped (absent) when this interpreter has no torch_npu at all."""
    if python is None and importlib.util.find_spec("torch_npu") is None:
        return {"status": "absent", "devices": 0, "detail": "torch_npu is not installed"}
    from agent.child_failure import child_failure
    from engine.backends.npu import import_blocks, import_timeout_s

    if python is None:
        blocked = import_blocks()      # this interpreter's torch_npu, bounded once per process
        if blocked:
            return {"status": "broken", "devices": 0, "detail": blocked}
    timeout = import_timeout_s() if timeout is None else timeout
    code = ("import json, torch, torch_npu\n"
            "print(json.dumps({'devices': int(torch.npu.device_count()), 'version': torch_npu.__version__}))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_STANDIN")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and Path(p).resolve() != pythonpath_dir())
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    try:
        proc = subprocess.run([python or sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"status": "broken", "devices": 0, "detail": f"probe did not finish: {exc}"}
    if proc.returncode != 0:
        detail = child_failure(proc.stderr or "", proc.returncode)
        if "No module named 'torch_npu'" in detail:
            return {"status": "absent", "devices": 0, "detail": "torch_npu is not installed"}
        return {"status": "broken", "devices": 0, "detail": detail[:300]}
    try:
        data = loads_json(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"status": "broken", "devices": 0, "detail": "probe printed no result"}
    devices = int(data.get("devices", 0))
    return {"status": "working" if devices > 0 else "no-device", "devices": devices,
            "detail": f"torch_npu {data.get('version')} sees {devices} NPU(s)"}


def host_problem(device: str) -> str | None:
    """Why the stand-in cannot map the NPU onto `device` here, or None."""
    if device == "cpu":
        return None
    if device == "cuda":
        try:
            import torch
        except Exception as exc:  # noqa: BLE001
            return f"torch cannot be imported ({exc})"
        if not torch.cuda.is_available():
            return "torch sees no CUDA device"
        return None
    return f"unknown stand-in device {device!r}"


def availability(torch_npu_status: str | None = None) -> dict:
    """For `migrator env`: can a stand-in run happen here, on which host devices, and why not.

    `torch_npu_status`: engine.environment's probe of the real torch_npu ("ok" means it imports);
    a stand-in run is refused only where it also sees an NPU, which the caller knows from the
    device selection, so "ok" alone is reported, not refused, here."""
    devices = [d for d in DEVICES if host_problem(d) is None]
    return {"possible": bool(devices), "devices": devices,
            "note": "npu -> host device, torch_npu kernels as reference implementations, host timings"}
