"""What every backend answers, like vLLM's Platform: a device type is one row of BACKENDS.

`problem(torch)` says why the device cannot be used here (None: it can), `hint(problem)` what to do,
`record(torch, kind, index, env)` adds its facts to the environment record of a run on `kind`, and
`module(torch)` is its torch module (torch.npu / torch.cuda; None on the CPU). `--device auto` takes
the first row without a problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Backend:
    name: str                                           # the torch device type: "npu" | "cuda" | "cpu"
    label: str                                          # for messages: "only N NPU device(s) are visible"
    problem: Callable[[object], str | None]
    hint: Callable[[str], str]
    record: Callable[[object, str, int | None, dict], None]

    def module(self, torch):
        return None if self.name == "cpu" else getattr(torch, self.name)
