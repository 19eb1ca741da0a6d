"""What records made under the stand-in say: never an NPU run. The one module that marks them.

* `baseline_file_name(baseline, standin)`: baseline_metadata.standin.json for a stand-in run, so that
  a stand-in result never takes the name (or the place) of an NPU baseline.
* `mark_run_baseline(baseline, logs, run_env)` / `mark_baseline(baseline, usage)`: a baseline collected
  from stand-in logs names the host device ("cpu (npu stand-in)"), has no NPU model or torch_npu
  version, marks its timings as the host's and carries a `standin` block (reference kernels run).
* `mark_report(report, baseline)`, `summary_lines(report)`: the migration report and summary of such
  a run say so too.
* `mark_environment(env)`: engine.environment's record in a process the stand-in is active in (the
  bootstrap wraps the engine's `detect_environment` with it: `mark_environment_module`).
* `usage_from_logs(paths)`: the merged stand-in usage of a run's rank logs, or None.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from npu_standin.record import merge, parse_log_text

STANDIN_LABEL = "npu stand-in"
TIMING_NOTE = "host timings of a validation run on the npu stand-in, not NPU figures"
CANONICAL_BASELINE = "baseline_metadata.json"
STANDIN_BASELINE = "baseline_metadata.standin.json"      # upstream recipes' and ours alike


def device_label(host: str | None) -> str:
    """How records name a device the stand-in ran on: "cpu (npu stand-in)", "cuda (npu stand-in)"."""
    kind = (host or "cpu").split(":", 1)[0]
    return f"{kind} ({STANDIN_LABEL})"


def baseline_file_name(baseline: dict, standin: bool = False) -> str:
    """The baseline's file name, from what it records: a run made under the npu stand-in (its
    `standin` block, or `standin` for a run the caller knows was one) is baseline_metadata.standin.json."""
    return STANDIN_BASELINE if standin or (baseline or {}).get("standin") else CANONICAL_BASELINE


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


def mark_run_baseline(baseline: dict, logs: list, run_env: dict | None) -> dict:
    """A run made under the npu stand-in says so (its logs carry the stand-in's lines, or its
    environment line names it); any other baseline is returned as it is."""
    usage = usage_from_logs(logs) or usage_from_environment(run_env)
    return mark_baseline(baseline, usage) if usage is not None else baseline


def mark_report(report: dict, baseline: dict | None) -> dict:
    """A report whose baseline was made under the npu stand-in says so too (device, reference kernels)."""
    baseline = baseline if isinstance(baseline, dict) else {}
    block = report.get("standin") or baseline.get("standin")
    if block:
        report["standin"] = block
        env = dict(report.get("env") or {})
        env["device"] = (baseline.get("environment") or {}).get("device") or device_label(env.get("device"))
        env["npu_model"] = None
        report["env"] = env
    return report


def summary_lines(report: dict) -> list[str]:
    """The lines of a migration summary that say a run was made under the stand-in."""
    lines = [f"- {STANDIN_LABEL} run: {note}" for note in (report.get("upstream_standin") or {}).get("notes") or []]
    if report.get("standin"):
        kernels = report["standin"].get("reference_kernels") or {}
        lines.append(f"- {STANDIN_LABEL}: a validation run, not an NPU run: torch_npu kernels ran as reference "
                     f"implementations ({', '.join(f'{k} x{v}' for k, v in kernels.items()) or 'none'}); "
                     "timings are the host's")
    return lines


def mark_environment_module(module) -> None:
    """Wrap an engine.environment module's `detect_environment` with `mark_environment` (once)."""
    detect = getattr(module, "detect_environment", None)
    if detect is None or getattr(detect, "_standin_marked", False):
        return

    @functools.wraps(detect)
    def detect_environment(*args, **kwargs):
        return mark_environment(detect(*args, **kwargs))

    detect_environment._standin_marked = True
    module.detect_environment = detect_environment


def mark_environment(env: dict) -> dict:
    """engine.environment.detect_environment() inside a stand-in process (a record already marked,
    by an older recipe engine that marked its own, is left as it is)."""
    from npu_standin import activate

    if not os.environ.get("NPU_STANDIN") or not activate.is_active():
        return env
    if (env.get("npu_standin") or {}).get("active"):
        return env
    host = env.get("device") or "cpu"
    env["device"] = device_label(host)
    env["npu_model"] = None
    env["torch_npu_version"] = None
    env["torch_npu_status"] = "npu stand-in (torch_npu is the stand-in's, no NPU)"
    env["torch_pair_ok"] = None
    env["npu_standin"] = {"active": True, "host": host, "note": TIMING_NOTE}
    return env
