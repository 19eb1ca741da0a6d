"""What records made under the stand-in say: never an NPU run.

* `mark_baseline(baseline, usage)`: a baseline collected from stand-in logs names the host device
  ("cpu (npu stand-in)"), has no NPU model or torch_npu version, marks its timings as the host's and
  carries a `standin` block (reference kernels run and how often).
* `mark_environment(env)`: engine.environment's record in a process the stand-in is active in.
* `usage_from_logs(paths)`: the merged stand-in usage of a run's rank logs, or None.
"""

from __future__ import annotations

import os
from pathlib import Path

from npu_standin import device_label
from npu_standin.record import merge, parse_log_text

TIMING_NOTE = "host timings of a validation run on the npu stand-in, not NPU figures"


def usage_from_logs(paths) -> dict | None:
    records, devices = [], []
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        parsed = parse_log_text(text)
        if parsed is None:
            continue
        devices.append(parsed["device"])
        records += parsed["records"]
    if not devices and not records:
        return None
    return merge(records, devices)


def usage_from_environment(env: dict | None) -> dict | None:
    """A log whose environment line was written under the stand-in (engine.environment) but that
    does not hold the stand-in's own lines: the host device, kernel counts unknown (in the run's
    --record folder)."""
    block = (env or {}).get("npu_standin") or {}
    if not block.get("active"):
        return None
    return {"device": block.get("host") or "cpu", "processes": None, "ranks": [], "ops": {}, "runtime": {},
            "compiles": {}, "unsupported": [], "counts_in_log": False}


def standin_block(usage: dict) -> dict:
    return {
        "device": usage.get("device"),
        "processes": usage.get("processes"),
        "ranks": usage.get("ranks"),
        "reference_kernels": usage.get("ops") or {},
        "runtime": usage.get("runtime") or {},
        "compiles": usage.get("compiles") or {},
        "unsupported": usage.get("unsupported") or [],
        "note": "torch_npu kernels ran as the stand-in's reference implementations in plain PyTorch on the "
                "host; " + TIMING_NOTE
                + ("" if usage.get("counts_in_log", True) else
                   "; this log holds no kernel counts (see the run's `migrator standin --record` folder)"),
    }


def mark_baseline(baseline: dict, usage: dict) -> dict:
    env = baseline.setdefault("environment", {})
    env["device"] = device_label(usage.get("device"))
    env["npu_model"] = None
    env["torch_npu_version"] = None
    env["cann_version"] = None
    ranks = usage.get("ranks") or []
    env["num_cards"] = 0
    baseline["standin"] = standin_block(usage)
    perf = baseline.setdefault("performance", {})
    perf["timing"] = TIMING_NOTE
    perf["bandwidth_fraction"] = None
    if ranks:
        baseline["standin"]["world_size"] = len(ranks)
    return baseline


def mark_environment(env: dict) -> dict:
    """engine.environment.detect_environment() inside a stand-in process."""
    from npu_standin import activate

    if not os.environ.get("NPU_STANDIN") or not activate.is_active():
        return env
    host = env.get("device") or "cpu"
    env["device"] = device_label(host)
    env["npu_model"] = None
    env["torch_npu_version"] = None
    env["torch_npu_status"] = "npu stand-in (torch_npu is the stand-in's, no NPU)"
    env["torch_pair_ok"] = None
    env["npu_standin"] = {"active": True, "host": host, "note": TIMING_NOTE}
    return env
