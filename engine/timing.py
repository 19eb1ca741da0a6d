"""Per-step timings without a host synchronize per step (gpt-fast style).

On CUDA / NPU each timed region is bracketed by two device events recorded on the current
stream; nothing waits for them until `elapsed_ms()`, which synchronizes once after the loop and
reads every interval. On CPU the ops run synchronously, so perf_counter brackets them exactly.
"""

from __future__ import annotations

import time

from engine import environment

torch = environment.import_torch()


class StepTimer:
    """start() / stop() around each step; elapsed_ms() after the loop: one figure per step."""

    def __init__(self, device):
        self.device = device
        self.backend = environment.device_module(device.type)
        self.intervals = []  # (start, end): device events, or perf_counter seconds on CPU
        self._start = None

    def start(self) -> None:
        self._start = self._mark()

    def stop(self) -> None:
        self.intervals.append((self._start, self._mark()))
        self._start = None

    def _mark(self):
        if self.backend is None:
            return time.perf_counter()
        event = self.backend.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self) -> list[float]:
        """Milliseconds of every start/stop pair, in order; synchronizes the device once."""
        if self.backend is None:
            return [(end - start) * 1000 for start, end in self.intervals]
        self.backend.synchronize(self.device)
        return [start.elapsed_time(end) for start, end in self.intervals]
