"""How a test's torchrun worker ends once its result is written.

torch's gloo teardown can abort the process after a run that succeeded ("terminate called without an active
exception", SIGABRT: gloo's worker threads still hold work objects when destroy_process_group or the interpreter's
finalization destroys them; pytorch/pytorch#179291 and #190489). Seen once in a CI run of ~1,000 two-rank
harness runs, never on a quiet host. A worker that has written its result and passed a barrier with every other
rank has nothing left to tear down that the test reads, so it leaves without finalization.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def end_rank(code: int = 0):
    """Wait for every rank to pass its last collective, then exit the process at once (no teardown)."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
