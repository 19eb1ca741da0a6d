"""What ran through the stand-in in this process, and reading it back from a run.

Each process the stand-in is active in says so on stderr when it activates (the `ACTIVE` line) and
writes, when it exits, one `USAGE` line (JSON) on stderr and, with NPU_STANDIN_RECORD_DIR set, a
`standin-<pid>.json` file there. A rank's log (`log_N.log`: upstream's launcher sends stdout and
stderr there) therefore carries its own record: `read_op_usage` reads record folders, log folders
or single logs alike.

`ops` counts every call of the process. Where a marker says where the model's forward calls begin and
end (npu_standin.steps: upstream's executor), `steps` also has the calls of each prefill and decode
step (warm-up and MTP calls left out, counted in `steps_excluded`), and per decoder layer where the
marker found the layers. Identical steps are one entry: {"phase", "steps": [their numbers],
"exe_mode", "compiled", "layers", "ops", "per_layer": {op: [calls in layer 0, 1, ..]},
"outside_layers": {op: calls}}; a compiled step's ops ran inside a captured graph, where no layer
hook runs: its calls are the step's, none attributed to a layer.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
import threading
from collections import Counter
from pathlib import Path

from npu_standin.engine_files import safe_load, safe_write

load_json, loads_json, run_folder_tree = safe_load.load_json, safe_load.loads_json, safe_write.run_folder_tree

ACTIVE_PREFIX = "[npu-standin] active:"
USAGE_PREFIX = "[npu-standin] usage "
ACTIVE_RE = re.compile(r"^\[npu-standin\] active: npu -> (?P<device>[a-z]+(?::\d+)?)\b", re.M)
USAGE_RE = re.compile(r"^\[npu-standin\] usage (?P<json>\{.*\})\s*$", re.M)

_lock = threading.Lock()
OPS: Counter = Counter()        # reference kernels: op name -> calls
RUNTIME: Counter = Counter()    # runtime stand-ins used: "hccl->gloo", "profiler (no-op)", ...
NOTES: dict[str, str] = {}      # one line each, first occurrence kept
UNSUPPORTED: list[dict] = []    # names called that the stand-in has no reference for
COMPILES: dict[str, dict] = {}  # compiled callable -> {"backend", "mode", "compiles", "recompiles", "fullgraph", "host_syncs", "eager_fallback"}
STEPS: list[dict] = []          # groups of identical forward steps (module docs)
STEPS_EXCLUDED: Counter = Counter()   # forward calls left out of STEPS: "warm-up", "mtp"
MAX_STEP_GROUPS = 64            # distinct step signatures kept; past it, "steps_truncated"
_state = {"device": None, "written": False, "step": None, "numbers": Counter(), "steps_truncated": 0}


def rank_from_env(env=os.environ) -> int | None:
    for key in ("RANK",):
        if env.get(key, "").isdigit():
            return int(env[key])
    if env.get("LOCAL_RANK", "").isdigit():
        return int(env["LOCAL_RANK"]) + int(env.get("RANK_OFFSET", "0") or 0)
    if env.get("RANK_ID", "").isdigit():
        return int(env["RANK_ID"])
    return None


def op(name: str) -> None:
    with _lock:
        OPS[name] += 1
        step = _state["step"]
        if step is not None:
            step["ops"][name] += 1
            layer = step["layer"]
            if layer is None:
                step["outside"][name] += 1
            else:
                step["per_layer"].setdefault(name, Counter())[layer] += 1


# ---- forward steps (marked by npu_standin.steps) -------------------------------------------
def step_begin(phase: str, *, exe_mode: str | None = None, compiled: bool = False, layers: int | None = None) -> None:
    """A forward call of the model begins: "prefill" or "decode"; `layers` the decoder layers the
    marker hooked (None: the calls are the step's only)."""
    with _lock:
        _state["numbers"][phase] += 1
        _state["step"] = {"phase": phase, "number": _state["numbers"][phase], "exe_mode": exe_mode,
                          "compiled": bool(compiled), "layers": layers, "layer": None, "ops": Counter(),
                          "outside": Counter(), "per_layer": {}}


def step_layer(index: int | None) -> None:
    """Calls from here on are decoder layer `index`'s (None: outside any layer)."""
    with _lock:
        step = _state["step"]
        if step is not None and step["layers"] and not step["compiled"]:
            step["layer"] = index if index is None or 0 <= index < step["layers"] else None


def step_end() -> None:
    with _lock:
        step, _state["step"] = _state["step"], None
        if step is None:
            return
        layers = step["layers"] if not step["compiled"] else None
        entry = {"phase": step["phase"], "exe_mode": step["exe_mode"], "compiled": step["compiled"],
                 "layers": layers, "ops": dict(sorted(step["ops"].items()))}
        if layers:
            entry["per_layer"] = {name: [calls.get(i, 0) for i in range(layers)]
                                  for name, calls in sorted(step["per_layer"].items())}
            entry["outside_layers"] = dict(sorted(step["outside"].items()))
        for group in STEPS:
            if {k: v for k, v in group.items() if k != "steps"} == entry:
                group["steps"].append(step["number"])
                return
        if len(STEPS) >= MAX_STEP_GROUPS:
            _state["steps_truncated"] += 1
            return
        STEPS.append({**entry, "steps": [step["number"]]})


def step_excluded(kind: str) -> None:
    with _lock:
        STEPS_EXCLUDED[kind] += 1


def _not_compiling() -> bool:
    return False


# torch.compiler.is_compiling once torch is active (npu_standin.compile.install); record is imported before torch.
compiling = _not_compiling


def runtime(name: str) -> None:
    # Traced by dynamo (a stream or event call inside a captured region): the count is the eager calls';
    # the lock is nothing a graph can hold.
    if compiling():
        return
    with _lock:
        RUNTIME[name] += 1


def note(key: str, text: str, echo: bool = True) -> None:
    """A one-line note, kept once per key (and printed once on stderr)."""
    with _lock:
        if key in NOTES:
            return
        NOTES[key] = text
    if echo:
        print(f"[npu-standin] {text}", file=sys.stderr, flush=True)


def unsupported(name: str, site: str) -> None:
    with _lock:
        UNSUPPORTED.append({"name": name, "site": site})


def fold_compile(entry: dict, fields: dict) -> dict:
    """`fields` of one compile (or one process's entry) folded into `entry`: counts add up, the capture is
    whole only if every one was, anything else is the latest."""
    for field, value in fields.items():
        if field in ("compiles", "recompiles", "host_syncs"):
            entry[field] = entry.get(field, 0) + value
        elif field == "fullgraph":
            entry[field] = bool(value) and entry.get(field, True)
        else:
            entry[field] = value
    return entry


def compile_event(key: str, **fields) -> dict:
    with _lock:
        return fold_compile(COMPILES.setdefault(key, {"compiles": 0, "recompiles": 0}), fields)


def snapshot() -> dict:
    with _lock:
        return {
            "pid": os.getpid(),
            "rank": rank_from_env(),
            "device": _state["device"],
            "argv": sys.argv[:8],
            "ops": dict(sorted(OPS.items())),
            "runtime": dict(sorted(RUNTIME.items())),
            "notes": dict(NOTES),
            "compiles": {k: dict(v) for k, v in COMPILES.items()},
            "unsupported": list(UNSUPPORTED),
            "steps": [{**g, "steps": list(g["steps"])} for g in STEPS],
            "steps_excluded": dict(sorted(STEPS_EXCLUDED.items())),
            "steps_truncated": _state["steps_truncated"],
        }


def announce(device: str) -> None:
    """The ACTIVE line, and the exit-time record."""
    _state["device"] = device
    rank = rank_from_env()
    print(f"{ACTIVE_PREFIX} npu -> {device} in pid {os.getpid()}"
          + (f" (rank {rank})" if rank is not None else "")
          + "; torch_npu and torchair are the stand-in's, torch_npu kernels run as reference "
            "implementations, timings are the host's", file=sys.stderr, flush=True)
    atexit.register(write)


def write() -> None:
    if _state["written"]:
        return
    _state["written"] = True
    data = snapshot()
    try:
        print(USAGE_PREFIX + json.dumps(data, separators=(",", ":")), file=sys.stderr, flush=True)
    except (OSError, ValueError):      # stderr already closed
        pass
    folder = os.environ.get("NPU_STANDIN_RECORD_DIR")
    if folder:
        try:      # the record folder the launcher named: nothing through a link out of it
            run_folder_tree(folder, "the stand-in's record folder", create=True).write_text(
                Path(folder) / f"standin-{os.getpid()}.json", json.dumps(data, indent=1) + "\n")
        except (OSError, ValueError):
            pass



# ---- reading a run back --------------------------------------------------------------------
def parse_log_text(text: str) -> dict | None:
    """The stand-in's facts in one log: {"device", "records": [...]} or None when it was not active."""
    active = ACTIVE_RE.search(text)
    records = []
    for m in USAGE_RE.finditer(text):
        try:
            records.append(loads_json(m.group("json")))
        except ValueError:
            continue
    if active is None and not records:
        return None
    device = active.group("device") if active else (records[0].get("device") if records else None)
    return {"device": device, "records": records}


def read_op_usage(path: str | os.PathLike) -> dict | None:
    """Merged usage of a run: a record folder (standin-*.json), a log folder (*.log) or one log.

    Returns None when nothing there was made under the stand-in, else
    {"device", "processes", "ranks", "ops": {op: calls}, "runtime", "notes", "compiles",
     "unsupported": [...], "per_process": [...]}. Each process counts once: a process that wrote
    both a JSON record and a USAGE line in a log is taken from the JSON record."""
    path = Path(path)
    records: dict[int, dict] = {}
    devices = []
    if path.is_dir():
        for item in sorted(path.glob("standin-*.json")):
            try:
                data = load_json(item)
            except (OSError, ValueError):
                continue
            records[data.get("pid", id(item))] = data
        logs = sorted(p for p in path.rglob("*.log") if p.is_file())
    elif path.is_file():
        logs = [path]
    else:
        return None
    for log in logs:
        try:
            parsed = parse_log_text(log.read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
        if parsed is None:
            continue
        devices.append(parsed["device"])
        for data in parsed["records"]:
            records.setdefault(data.get("pid", id(data)), data)
    if not records and not devices:
        return None
    return merge(list(records.values()), devices)


def merge(records: list[dict], devices: list | None = None) -> dict:
    ops: Counter = Counter()
    runtime_uses: Counter = Counter()
    notes: dict = {}
    compiles: dict = {}
    unsupported_calls: list = []
    for data in records:
        ops.update(data.get("ops") or {})
        runtime_uses.update(data.get("runtime") or {})
        for key, text in (data.get("notes") or {}).items():
            notes.setdefault(key, text)
        for key, entry in (data.get("compiles") or {}).items():
            fold_compile(compiles.setdefault(key, {"compiles": 0, "recompiles": 0}), entry)
        unsupported_calls += data.get("unsupported") or []
    device = next((d.get("device") for d in records if d.get("device")), None) or next(
        (d for d in devices or [] if d), None)
    ranks = sorted({d["rank"] for d in records if d.get("rank") is not None})
    return {
        "device": device,
        "processes": len(records),
        "ranks": ranks,
        "ops": dict(ops.most_common()),
        "runtime": dict(sorted(runtime_uses.items())),
        "notes": notes,
        "compiles": compiles,
        "unsupported": unsupported_calls,
        "per_process": [{"pid": d.get("pid"), "rank": d.get("rank"), "argv": d.get("argv"),
                         "ops": d.get("ops") or {}, "steps": d.get("steps") or [],
                         "steps_excluded": d.get("steps_excluded") or {},
                         "steps_truncated": d.get("steps_truncated") or 0} for d in records],
    }
