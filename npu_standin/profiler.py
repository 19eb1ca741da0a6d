"""torch_npu.profiler under the stand-in: a no-op that says so.

There is no NPU to trace: `profile` runs its body, counts steps, writes nothing and never calls
`on_trace_ready`. The first profile started in a process prints one line saying so.
"""

from __future__ import annotations

import enum
import types

import torch

from npu_standin import record


class ProfilerActivity(enum.Enum):
    CPU = "CPU"
    NPU = "NPU"


class ProfilerLevel(enum.Enum):
    Level_none = "Level_none"
    Level0 = "Level0"
    Level1 = "Level1"
    Level2 = "Level2"


class AiCMetrics(enum.Enum):
    AiCoreNone = "AiCoreNone"
    PipeUtilization = "PipeUtilization"
    ArithmeticUtilization = "ArithmeticUtilization"
    Memory = "Memory"
    MemoryL0 = "MemoryL0"
    MemoryUB = "MemoryUB"
    ResourceConflictRatio = "ResourceConflictRatio"
    L2Cache = "L2Cache"


class ExportType(enum.Enum):
    Db = "db"
    Text = "text"


class _ExperimentalConfig:
    def __init__(self, **kwargs):
        self.settings = dict(kwargs)


class ProfilerAction(enum.Enum):
    NONE = 0
    WARMUP = 1
    RECORD = 2
    RECORD_AND_SAVE = 3


def schedule(*, wait: int = 0, warmup: int = 0, active: int = 1, repeat: int = 0, skip_first: int = 0):
    return torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=repeat, skip_first=skip_first)


def tensorboard_trace_handler(dir_name: str, worker_name: str | None = None, analyse_flag: bool = True, **kwargs):
    def handler(prof):   # never called: the stand-in's profile records nothing
        return None

    handler.dir_name = dir_name
    return handler


class profile:  # noqa: N801 - torch_npu.profiler.profile
    def __init__(self, activities=None, schedule=None, on_trace_ready=None, record_shapes=False,
                 profile_memory=False, with_stack=False, with_flops=False, with_modules=False,
                 experimental_config=None, **kwargs):
        self.step_num = 0
        self.on_trace_ready = on_trace_ready

    def start(self):
        record.runtime("torch_npu.profiler (no-op)")
        record.note("profiler", "torch_npu.profiler is a no-op on the stand-in: no NPU trace is written")
        return self

    def stop(self):
        return None

    def step(self):
        self.step_num += 1

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    def export_chrome_trace(self, path):
        record.note("profiler-export", "torch_npu.profiler: nothing to export on the stand-in")

    def add_metadata(self, *args, **kwargs):
        return None

    def add_metadata_json(self, *args, **kwargs):
        return None


def supported_activities():
    return {ProfilerActivity.CPU, ProfilerActivity.NPU}


def build() -> types.ModuleType:
    module = types.ModuleType("torch_npu.profiler", __doc__)
    for name in ("ProfilerActivity", "ProfilerLevel", "AiCMetrics", "ExportType", "_ExperimentalConfig",
                 "ProfilerAction", "schedule", "tensorboard_trace_handler", "profile", "supported_activities"):
        setattr(module, name, globals()[name])
    module.record_function = torch.profiler.record_function
    module.__npu_standin__ = True
    return module
