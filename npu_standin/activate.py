"""Activate the stand-in in this process: `npu` is the host device, torch.npu / torch_npu / torchair
are the stand-in's, HCCL is gloo/nccl, torch_npu kernels are the references (torch.matmul / mm of mixed dtypes
promote as on the NPU: kernels/matmul.py), NPU compile backends
are torch.compile's. Called at the end of `import torch` (bootstrap.TorchHook), once.
"""

from __future__ import annotations

import os
import sys

from npu_standin.environment import DEVICES, ENV_DEVICE

_state = {"active": False}


def is_active() -> bool:
    return _state["active"]


def activate(device: str | None = None) -> None:
    if _state["active"]:
        return
    device = device or os.environ.get(ENV_DEVICE, "cpu")
    if device not in DEVICES:
        raise RuntimeError(f"npu stand-in: unknown device {device!r} in {ENV_DEVICE}; use cpu or cuda")
    _state["active"] = True
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("npu stand-in: NPU_STANDIN=cuda but torch sees no CUDA device")
    from npu_standin import compile as _compile
    from npu_standin import device as _dev
    from npu_standin import dist, kernels, npu_module, record

    _dev.install(device)
    npu_module.install()
    dist.install()
    kernels.install()
    kernels.install_torch_ops()
    _compile.install()
    host = "cpu" if device == "cpu" else f"cuda:{torch.cuda.current_device()}"
    if os.environ.get(ENV_DEVICE) != device:
        os.environ[ENV_DEVICE] = device
    record.announce(host)
    sys.modules.setdefault("npu_standin", sys.modules[__name__.rsplit(".", 1)[0]])
