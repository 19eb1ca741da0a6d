"""An NPU stand-in: run NPU code on the cpu or a CUDA card to validate it, never to pretend.

Under the stand-in, `torch_npu`, `torchair` and `torch.npu` resolve to this package: the device type
`npu` lands on the host device, HCCL on gloo / nccl, streams and events keep their ordering on the host,
the profiler is a no-op that says so, torchair / npugraph_ex compile with torch.compile where the host
can, and torch_npu kernels run as reference implementations in plain PyTorch (`kernels.REFERENCES`).
It is active only in processes started with `standin_env()` (what `migrator standin` does), and every
process says so on stderr and leaves a record of the reference kernels it ran.

API for launchers (nothing here imports torch):

* `standin_env(device, base=None, record_dir=None)`: the environment to run a command with.
* `probe_real_torch_npu()`: whether a working torch_npu is installed (then the stand-in refuses).
* `read_op_usage(path)`: the merged record of a run, from a record folder, a log folder or a log.
* `run(command, device="cpu", ...)`: run a command under the stand-in; its exit code and record.
"""

from __future__ import annotations

from npu_standin.environment import (  # noqa: F401
    DEVICES,
    ENV_DEVICE,
    ENV_RECORD_DIR,
    availability,
    host_problem,
    is_active,
    probe_real_torch_npu,
    pythonpath_dir,
    standin_env,
)
from npu_standin.record import parse_log_text, read_op_usage  # noqa: F401

def run(*args, **kwargs):
    from npu_standin.launcher import run as _run

    return _run(*args, **kwargs)
