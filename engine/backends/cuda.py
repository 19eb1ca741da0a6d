"""The CUDA backend: whether torch sees a CUDA device, and its facts for the environment record."""

from __future__ import annotations

from engine.backends.base import Backend
from engine.backends.common import short_error

LABEL = "CUDA"   # in "only N CUDA device(s) are visible"


def device_problem(torch) -> str | None:
    """None when a CUDA device can be used, else a short description of why not."""
    try:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return None
    except Exception as exc:
        return f"torch.cuda failed: {short_error(exc)}"
    if getattr(torch.version, "cuda", None) is None:
        return f"torch {torch.__version__} is built without CUDA"
    return "no CUDA device is available (torch.cuda.is_available() is False)"


def device_hint(problem: str) -> str:
    return "use --device cpu"


def record_device(torch, kind: str, index: int | None, env: dict) -> None:
    """The CUDA device's name and memory, recorded whenever one is visible (also on npu / cpu
    runs); its memory is the run's device memory when the run is on CUDA. Each rank records its own
    card only: accelerate's get_max_memory (agent.measure.memory.card_memory) puts a tensor on every
    visible card, so it is asked once, in a child process, for the out-of-memory estimate."""
    try:
        if torch.cuda.is_available():
            idx = index if kind == "cuda" and index is not None else 0
            props = torch.cuda.get_device_properties(idx)
            env["cuda_device_name"] = str(props.name)
            env["cuda_memory_bytes"] = int(props.total_memory)
            if kind == "cuda":
                env["device_memory_bytes"] = int(props.total_memory)
    except Exception:
        pass


BACKEND = Backend("cuda", LABEL, device_problem, device_hint, record_device)
