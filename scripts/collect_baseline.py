#!/usr/bin/env python3
"""Collect a recipe's performance baseline from its inference logs.

    python3 scripts/collect_baseline.py --log-file RES_PATH_OR_LOG --output OUT.json \\
        --yaml-file config/model.yaml [--rank N] [--model-source SRC]

Reads the log(s) written by ``bash infer.sh`` (``${RES_PATH}/log_{rank}.log``),
finds the formal (non-warm-up) generate call and writes the baseline JSON:
prefill = first forward of the formal call, decode = mean of its decode forwards
without the first decode step. Values that were not measured are ``null``.

Exit codes: 0 written; 2 bad input (missing/unreadable log or YAML, bad
arguments); 3 the log has no formal prefill line (the run failed); 1 anything
unexpected. Errors are one line on stderr, never a traceback.

Works both as a script (from any cwd) and as an importable module.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import importlib.metadata
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

PROG = "collect_baseline"

EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_BAD_INPUT = 2
EXIT_RUN_FAILED = 3

ENVIRONMENT_KEYS = (
    "npu_model", "num_cards", "cann_version", "pytorch_version",
    "torch_npu_version", "exe_mode", "device",
)

# --------------------------------------------------------------------------- errors


class CollectError(Exception):
    """An expected failure: reported as one stderr line and an exit code."""

    def __init__(self, what: str, todo: str, code: int = EXIT_BAD_INPUT):
        super().__init__(f"{what} — {todo}")
        self.what = what
        self.todo = todo
        self.code = code

    def line(self) -> str:
        return f"{PROG}: error: {self.what} — {self.todo}"


# --------------------------------------------------------------------------- log grammar

# Our engine: "[2026-11-29 17:40:01,123] [INFO] message".
_HEADER_RE = re.compile(
    r"^\[\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?\]\s*\[[A-Z]+\]")
# Upstream / other loggers: a line starting with a date or time, or a level tag.
_OTHER_START_RE = re.compile(
    r"^\s*\[?(?:\d{4}[-/]\d{2}[-/]\d{2}[ T_]\d{2}:\d{2}|\d{2}:\d{2}:\d{2}\b)"
    r"|^\[(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL)\]"
    r"|^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):"
    # glog-style lines from C++ (torch_npu, HCCL): "[W1129 17:40:01.123456 ...".
    r"|^\[?[IWEF]\d{4} \d{2}:\d{2}:\d{2}")

_NUM = r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_TIME_RE = re.compile(
    r"(?P<model>\S+) inference time cost of (?P<stage>prefill|decode) is (?P<ms>" + _NUM + r") ms")
# cann-recipes-infer framework mode (executor/core/scheduler): one line per forward step, logged with
# "[%(levelname)s][%(asctime)s.%(msecs)03d][%(filename)s:%(lineno)d] %(message)s". The engine warms
# up inside OfflineInference before the formal call without logging these lines.
_FW_TIME_RE = re.compile(
    r"\[Main\] Inference time \((?P<stage>prefill|decode)\): (?P<ms>" + _NUM + r") ms")
_FW_AVERAGE_RE = re.compile(
    r"(?P<model>\S+) decode average inference time cost is (?P<ms>" + _NUM + r") ms")
# Upstream ModelRunner logs this after the decode loop of non-warm-up calls only.
_AVERAGE_RE = re.compile(r"(?P<model>\S+) average inference time cost is (?P<ms>" + _NUM + r") ms")
_OUTPUT_RE = re.compile(r"Request (?P<idx>\d+): outputs: ?(?P<text>.*)$")
# Some upstream versions: "Inference decode result for batch 0: \n<text>".
_UPSTREAM_OUTPUT_RE = re.compile(r"Inference decode result for batch (?P<idx>\d+): ?(?P<text>.*)$")
_ENV_RE = re.compile(r"(?P<model>\S+) environment: (?P<json>\{.*)$")
_WARMUP_RE = re.compile(r"(?P<model>\S+) warm-up run (?P<edge>begins|ends)\b")
_TRACEBACK_RE = re.compile(r"Traceback \(most recent call last\):")

_MESSAGE_RES = (_TIME_RE, _FW_TIME_RE, _AVERAGE_RE, _OUTPUT_RE, _UPSTREAM_OUTPUT_RE, _ENV_RE,
                _WARMUP_RE, _TRACEBACK_RE)


def is_record_start(line: str) -> bool:
    """True if ``line`` starts a log record (anything else continues the previous one)."""
    if _HEADER_RE.search(line) or _OTHER_START_RE.search(line):
        return True
    return any(rx.search(line) for rx in _MESSAGE_RES)


@dataclass
class Record:
    line_no: int            # 1-based line of the record's first line
    first: str              # the record's first line
    continuation: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "\n".join([self.first, *self.continuation])


def split_records(text: str) -> list[Record]:
    records: list[Record] = []
    for line_no, line in enumerate(text.split("\n"), 1):
        line = line.rstrip("\r")
        if not records or is_record_start(line):
            records.append(Record(line_no, line))
        else:
            records[-1].continuation.append(line)
    return records


# --------------------------------------------------------------------------- log model


@dataclass
class Segment:
    """One generate call: its prefill line and everything up to the next boundary."""

    line_no: int
    warmup: bool
    prefill_ms: float
    model_name: str
    decode_ms: list[float] = field(default_factory=list)
    outputs: dict[int, str] = field(default_factory=dict)
    has_average: bool = False
    framework: bool = False          # "[Main] Inference time (...)" lines
    reported_average_ms: Optional[float] = None   # the recipe's own "... average ..." figure

    @property
    def complete(self) -> bool:
        return bool(self.outputs)

    def output_text(self) -> Optional[str]:
        if not self.outputs:
            return None
        return self.outputs.get(0, self.outputs[min(self.outputs)])


@dataclass
class Run:
    """One invocation of the engine appended to the log."""

    line_no: int
    env: Optional[dict] = None
    env_line: Optional[int] = None
    has_markers: bool = False
    segments: list[Segment] = field(default_factory=list)
    tracebacks: list[tuple[int, str]] = field(default_factory=list)  # (line, last line)

    def is_empty(self) -> bool:
        return not self.segments and self.env is None and not self.tracebacks

    @property
    def framework(self) -> bool:
        return any(s.framework for s in self.segments)

    def warmed_up(self) -> bool:
        """The log shows a warm-up: markers, more than one generate call, or the framework engine
        (which warms up inside OfflineInference before the formal call, without timing lines)."""
        if self.framework:
            return True
        if self.has_markers:
            return any(s.warmup for s in self.segments)
        return len(self.segments) > 1

    def formal_candidates(self) -> list[Segment]:
        if self.has_markers:
            return [s for s in self.segments if not s.warmup]
        return list(self.segments)


@dataclass
class ParsedLog:
    path: Path
    runs: list[Run]
    warnings: list[str] = field(default_factory=list)


def _output_text(match: re.Match, record: Record, upstream: bool) -> str:
    parts = [match.group("text"), *record.continuation]
    if upstream and not parts[0].strip():
        parts = parts[1:]  # the text starts on the next line
    return "\n".join(parts).rstrip("\r\n")


def parse_log_text(text: str, path: Path | str = "<log>") -> ParsedLog:
    """Split a log into runs and generate-call segments."""
    path = Path(path)
    parsed = ParsedLog(path, [Run(1)])
    seg: Optional[Segment] = None
    in_warmup = False

    def new_run(line_no: int) -> Run:
        run = parsed.runs[-1]
        if not run.is_empty():
            run = Run(line_no)
            parsed.runs.append(run)
        run.line_no = line_no
        return run

    for rec in split_records(text):
        line = rec.first
        m = _FW_TIME_RE.search(line)
        if m:
            ms = float(m.group("ms"))
            if m.group("stage") == "prefill":
                if seg is not None and seg.framework and not seg.decode_ms and not seg.outputs:
                    continue  # another prefill batch of the same call: the first one is measured
                seg = Segment(rec.line_no, in_warmup, ms, "", framework=True)
                parsed.runs[-1].segments.append(seg)
            elif seg is not None:
                seg.decode_ms.append(ms)
            else:
                parsed.warnings.append(
                    f"{path.name}:{rec.line_no}: decode line without a preceding prefill line ignored")
            continue
        m = _TIME_RE.search(line)
        if m:
            ms = float(m.group("ms"))
            if m.group("stage") == "prefill":
                seg = Segment(rec.line_no, in_warmup, ms, m.group("model"))
                parsed.runs[-1].segments.append(seg)
            elif seg is not None:
                seg.decode_ms.append(ms)
            else:
                parsed.warnings.append(
                    f"{path.name}:{rec.line_no}: decode line without a preceding prefill line ignored")
            continue
        m = _OUTPUT_RE.search(line) or _UPSTREAM_OUTPUT_RE.search(line)
        if m:
            if seg is not None:
                upstream = m.re is _UPSTREAM_OUTPUT_RE
                seg.outputs.setdefault(int(m.group("idx")), _output_text(m, rec, upstream))
            continue
        m = _FW_AVERAGE_RE.search(line) or _AVERAGE_RE.search(line)
        if m:
            if seg is not None:
                seg.has_average = True
                seg.reported_average_ms = float(m.group("ms"))
            continue
        m = _WARMUP_RE.search(line)
        if m:
            seg = None
            if m.group("edge") == "begins":
                run = parsed.runs[-1]
                if any(not s.warmup for s in run.segments):
                    # a formal call already happened: this is a new, appended run
                    run = new_run(rec.line_no)
                run.has_markers = True
                in_warmup = True
            else:
                parsed.runs[-1].has_markers = True
                in_warmup = False
            continue
        m = _ENV_RE.search(line)
        if m:
            seg = None
            in_warmup = False
            run = new_run(rec.line_no)
            raw = "\n".join([m.group("json"), *rec.continuation])
            try:
                env, _ = json.JSONDecoder().raw_decode(raw)
            except ValueError:
                env = None
            if isinstance(env, dict):
                run.env, run.env_line = env, rec.line_no
            else:
                parsed.warnings.append(
                    f"{path.name}:{rec.line_no}: environment line is not a JSON object; ignored")
            continue
        if _TRACEBACK_RE.search(line):
            seg = None
            tail = [ln.strip() for ln in rec.continuation if ln.strip()]
            parsed.runs[-1].tracebacks.append((rec.line_no, tail[-1] if tail else line.strip()))
            continue
    return parsed


def read_log(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise CollectError(f"cannot read log file {path}: {exc.strerror or exc}",
                           "check the path and its permissions") from None


def parse_log_file(path: Path) -> ParsedLog:
    return parse_log_text(read_log(path), path)


# --------------------------------------------------------------------------- formal run


@dataclass
class Selection:
    """The formal generate call chosen from one log, and how it was chosen."""

    parsed: ParsedLog
    segment: Optional[Segment]
    run: Optional[Run]
    success: bool
    warnings: list[str] = field(default_factory=list)

    @property
    def last_traceback(self) -> Optional[tuple[int, str]]:
        tbs = [tb for run in self.parsed.runs for tb in run.tracebacks]
        return tbs[-1] if tbs else None


def select_formal(parsed: ParsedLog) -> Selection:
    """Pick the formal generate call of the last run (see module docs for the rules)."""
    name = parsed.path.name
    warnings = list(parsed.warnings)
    runs = parsed.runs
    last = runs[-1]
    cands = last.formal_candidates()
    chosen: Optional[Segment] = None
    chosen_run: Optional[Run] = None
    fell_back = False

    def pick_complete(run: Run) -> Optional[Segment]:
        complete = [s for s in run.formal_candidates() if s.complete]
        if not run.has_markers:
            averaged = [s for s in complete if s.has_average]
            if averaged:  # upstream logs the average for non-warm-up calls only
                return averaged[-1]
        return complete[-1] if complete else None

    if cands and cands[-1].complete and (last.has_markers or pick_complete(last) is cands[-1]):
        chosen, chosen_run = cands[-1], last
    else:
        found = pick_complete(last)
        if found is not None:
            chosen, chosen_run, fell_back = found, last, True
            if cands and not cands[-1].complete:
                warnings.append(
                    f"{name}: the last generate call (line {cands[-1].line_no}) has no "
                    f"'Request N: outputs:' line (interrupted run?); using the last complete "
                    f"one (line {found.line_no})")
            else:
                warnings.append(
                    f"{name}: using the last complete non-warm-up generate call "
                    f"(line {found.line_no}) rather than the last one")
        else:
            for run in reversed(runs[:-1]):
                found = pick_complete(run)
                if found is not None:
                    chosen, chosen_run, fell_back = found, run, True
                    warnings.append(
                        f"{name}: the last run (from line {last.line_no}) has no complete formal "
                        f"generate call; using an earlier run's (line {found.line_no})")
                    break
        if chosen is None:
            for run in reversed(runs):
                rc = run.formal_candidates()
                if rc:
                    chosen, chosen_run, fell_back = rc[-1], run, True
                    warnings.append(
                        f"{name}: the formal generate call (line {rc[-1].line_no}) has no "
                        f"'Request N: outputs:' line (interrupted run?); output_text is null")
                    break

    if chosen is not None and chosen_run is not None and not chosen_run.has_markers:
        if len(chosen_run.segments) == 1 and not chosen_run.framework:
            warnings.append(
                f"{name}: no warm-up detected (one generate call, no warm-up markers); its "
                "prefill may include compile/warm-up cost")

    success = (chosen is not None and chosen.complete and not fell_back
               and not last.tracebacks)
    for line_no, msg in last.tracebacks:
        warnings.append(f"{name}:{line_no}: traceback: {msg}")
    return Selection(parsed, chosen, chosen_run, success, warnings)


def measure(segment: Segment) -> tuple[Optional[float], Optional[float], list[str]]:
    """(prefill_ms, decode_avg_ms, warnings) of a formal generate call."""
    warnings: list[str] = []
    prefill = round(segment.prefill_ms, 2)
    decodes = segment.decode_ms
    if not decodes:
        decode_avg = None
        warnings.append("formal run has no decode step; decode_avg_ms is null")
    elif len(decodes) == 1:
        decode_avg = None
        warnings.append("formal run has only one decode step, which is excluded as the first; "
                        "decode_avg_ms is null (generate more tokens to measure decode)")
    else:
        rest = decodes[1:]
        decode_avg = round(sum(rest) / len(rest), 2)
    return prefill, decode_avg, warnings


# --------------------------------------------------------------------------- inputs


_RANK_LOG_RE = re.compile(r"^log_(\d+)\.log$")


def resolve_logs(log_arg: str, rank: int) -> tuple[Path, list[tuple[int, Path]]]:
    """(log of the selected rank, every rank log to check for all_ranks_success)."""
    path = Path(log_arg)
    if path.is_dir():
        ranks = sorted((int(m.group(1)), p) for p in path.iterdir()
                       if (m := _RANK_LOG_RE.match(p.name)) and p.is_file())
        chosen = path / f"log_{rank}.log"
        if not chosen.is_file():
            found = ", ".join(p.name for _, p in ranks) or "no log_*.log files"
            raise CollectError(f"log file {chosen} not found (directory has: {found})",
                               "run 'bash infer.sh' first or pass --rank / --log-file correctly")
        return chosen, ranks
    if path.is_file():
        m = _RANK_LOG_RE.match(path.name)
        return path, [(int(m.group(1)) if m else rank, path)]
    raise CollectError(f"log file or directory {path} not found",
                       "run 'bash infer.sh' first (it writes ${RES_PATH}/log_{rank}.log) "
                       "or pass the right --log-file")


def load_yaml(yaml_arg: str) -> dict:
    path = Path(yaml_arg)
    if not path.is_file():
        raise CollectError(f"YAML file {path} not found",
                           "pass the recipe's config YAML with --yaml-file")
    try:
        import yaml  # PyYAML
    except ImportError:
        raise CollectError("PyYAML is not installed", "pip install pyyaml") from None
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CollectError(f"cannot read YAML file {path}: {exc.strerror or exc}",
                           "check its permissions") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}"
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise CollectError(f"cannot parse YAML file {path}{where}: {problem}",
                           "fix the YAML syntax") from None
    if not isinstance(data, dict):
        raise CollectError(f"YAML file {path} is not a mapping of settings",
                           "pass the recipe's config YAML (model_name, model_path, exe_mode, ...)")
    return data


def _section(cfg: dict, name: str) -> dict:
    value = cfg.get(name)
    return value if isinstance(value, dict) else {}


def yaml_settings(cfg: dict) -> dict:
    """The settings a baseline records, from either YAML schema of cann-recipes-infer.

    Legacy (ModelRunner): top-level ``model_name / model_path / exe_mode / world_size`` and
    ``data_config.{max_new_tokens, batch_size, input_max_len}``. Framework: ``model_config.{model_name,
    model_path, exe_mode}``, ``parallel_config.world_size``, ``scheduler_config.{max_new_tokens,
    batch_size}``, ``data_config.input_truncated_len``. Where both are present the framework's
    section wins (it is what the framework reads; the top-level keys are kept for compatibility).
    ``exe_mode`` is recorded as written (``eager``, ``ge_graph``, ``npugraph_ex``, or anything else).
    """
    model = _section(cfg, "model_config")
    parallel = _section(cfg, "parallel_config")
    scheduler = _section(cfg, "scheduler_config")
    data = _section(cfg, "data_config")

    def first(*values):
        return next((v for v in values if v is not None and v != ""), None)

    return {
        "model_name": first(model.get("model_name"), cfg.get("model_name")),
        "model_path": first(model.get("model_path"), cfg.get("model_path")),
        "model_source": first(model.get("model_source"), cfg.get("model_source")),
        "exe_mode": first(model.get("exe_mode"), cfg.get("exe_mode")),
        "world_size": first(parallel.get("world_size"), cfg.get("world_size")),
        "max_new_tokens": first(scheduler.get("max_new_tokens"), data.get("max_new_tokens")),
        "batch_size": first(scheduler.get("batch_size"), data.get("batch_size")),
        "input_len": first(data.get("input_truncated_len"), data.get("input_max_len")),
    }


def yaml_relpath(yaml_arg: str) -> str:
    """Path relative to the recipe dir (parent of the YAML's config/ dir), else as given."""
    path = Path(yaml_arg).resolve()
    for parent in path.parents:
        if parent.name == "config":
            return path.relative_to(parent.parent).as_posix()
    return yaml_arg


# --------------------------------------------------------------------------- engine helpers


def _import_engine(module: str, attr: str) -> Optional[Callable]:
    """``engine.<module>.<attr>``, adding the repo root to sys.path if needed; None if absent."""
    name = f"engine.{module}"
    for attempt in range(2):
        try:
            mod = importlib.import_module(name)
            return getattr(mod, attr)
        except Exception:  # ImportError, or a broken/half-written module
            if attempt:
                return None
            root = str(Path(__file__).resolve().parent.parent)
            if root in sys.path:
                return None
            sys.path.insert(0, root)
            for stale in [k for k, v in sys.modules.items()
                          if (k == "engine" or k.startswith("engine.")) and v is None]:
                del sys.modules[stale]
            importlib.invalidate_caches()
    return None


def _dist_version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    except Exception:
        return None


def detect_local_environment() -> tuple[dict, Optional[str]]:
    """Environment of this machine (when the log has none), and a note about its source."""
    detect = _import_engine("environment", "detect_environment")
    if detect is not None:
        try:
            env = detect()
            if isinstance(env, dict):
                return env, None
        except Exception as exc:
            note = f"detect_environment() failed ({type(exc).__name__}: {exc})"
            return _fallback_environment(), note
    return _fallback_environment(), "engine.environment is unavailable"


def _fallback_environment() -> dict:
    return {"pytorch_version": _dist_version("torch"),
            "torch_npu_version": _dist_version("torch_npu")}


def build_environment(log_env: Optional[dict], yaml_cfg: dict, n_rank_logs: int,
                      warnings: list[str]) -> dict:
    if log_env is not None:
        source = dict(log_env)
    else:
        source, note = detect_local_environment()
        msg = ("no environment line in the log; environment detected on this machine at "
               "collection time")
        warnings.append(msg + (f" ({note}; only package versions filled)" if note else ""))
    env = {key: source.get(key) for key in ENVIRONMENT_KEYS}
    settings = yaml_settings(yaml_cfg)
    env["exe_mode"] = settings["exe_mode"] if settings["exe_mode"] is not None else source.get("exe_mode")
    world_size = _as_int(source.get("world_size")) if log_env is not None else None
    if world_size is None:
        world_size = _as_int(settings["world_size"])
    if world_size is None and n_rank_logs:
        world_size = n_rank_logs
    device = env.get("device")
    if device in ("npu", "cuda"):
        env["num_cards"] = world_size if world_size is not None else env.get("num_cards")
    elif device == "cpu":
        env["num_cards"] = 0
    return env


def _as_int(value: Any) -> Optional[int]:
    try:
        return int(value) if value is not None and not isinstance(value, bool) else None
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------- output


def keep_previous(out: Path) -> Optional[Path]:
    """Move an existing ``out`` beside itself as ``<stem>.previous-<mtime>.json``."""
    if not out.exists():
        return None
    stamp = _dt.datetime.fromtimestamp(out.stat().st_mtime).strftime("%Y%m%dT%H%M%S")
    kept = out.with_name(f"{out.stem}.previous-{stamp}{out.suffix}")
    n = 1
    while kept.exists():
        kept = out.with_name(f"{out.stem}.previous-{stamp}-{n}{out.suffix}")
        n += 1
    os.replace(out, kept)
    return kept


def write_json(out: Path, data: dict) -> Optional[Path]:
    """Write ``data`` to ``out`` atomically, keeping a previous file; returns the kept path."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(data, fh, indent=2, ensure_ascii=False)
                fh.write("\n")
            kept = keep_previous(out)
            os.replace(tmp, out)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    except OSError as exc:
        raise CollectError(f"cannot write {out}: {exc.strerror or exc}",
                           "check that the output directory is writable") from None
    return kept


def collect(log_arg: str, yaml_arg: str, rank: int = 0,
            model_source: Optional[str] = None) -> tuple[dict, list[str]]:
    """Build the baseline dict. Raises CollectError on bad input or a failed run."""
    cfg = load_yaml(yaml_arg)
    log_path, rank_logs = resolve_logs(log_arg, rank)
    selection = select_formal(parse_log_file(log_path))
    seg = selection.segment
    if seg is None:
        tb = selection.last_traceback
        why = f"; last error at line {tb[0]}: {tb[1]}" if tb else ""
        raise CollectError(
            f"{log_path} has no formal prefill line, the run failed{why}",
            "fix the run (see the log) and rerun 'bash infer.sh' before collecting",
            EXIT_RUN_FAILED)
    warnings = list(selection.warnings)

    all_ok = selection.success
    for r, path in rank_logs:
        if path.resolve() == log_path.resolve():
            continue
        try:
            other = select_formal(parse_log_file(path))
        except CollectError as exc:
            warnings.append(f"rank {r}: {exc.what}")
            all_ok = False
            continue
        if not other.success:
            all_ok = False
            tb = other.last_traceback
            detail = (f"traceback at line {tb[0]}: {tb[1]}" if tb
                      else "no complete formal generate call")
            warnings.append(f"rank {r} ({path.name}) failed: {detail}")

    prefill, decode_avg, mwarn = measure(seg)
    warnings.extend(mwarn)
    text = seg.output_text()
    check = None
    if text is not None:
        checker = _import_engine("output_check", "check_output_text")
        if checker is not None:
            check = checker(text)
            if not check.get("ok"):
                warnings.append("output text check failed: " + "; ".join(check.get("reasons", [])))
        else:
            warnings.append("engine.output_check is unavailable; output_check is null")

    run_env = selection.run.env if selection.run is not None else None
    environment = build_environment(run_env, cfg, len(rank_logs), warnings)
    settings = yaml_settings(cfg)
    model_name = settings["model_name"] or seg.model_name or None
    source = model_source or settings["model_source"] or settings["model_path"]
    if seg.reported_average_ms is not None and decode_avg is not None \
            and abs(seg.reported_average_ms - decode_avg) > 0.005:
        warnings.append(
            f"the recipe's own log reports an average of {seg.reported_average_ms:.2f} ms; decode_avg_ms "
            f"is the mean of the decode steps after the first ({decode_avg:.2f} ms), the same definition "
            "for every log style")

    baseline = {
        "timestamp": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "yaml_path": yaml_relpath(yaml_arg),
        "environment": environment,
        "model_config": {"model_name": model_name, "model_source": source},
        "performance": {"prefill_ms": prefill, "decode_avg_ms": decode_avg, "output_text": text},
        "verification": {
            "all_ranks_success": all_ok,
            "output_check": check,
            "parity": None,
            "collection_warnings": warnings,
        },
    }
    return baseline, warnings


# --------------------------------------------------------------------------- CLI


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        raise CollectError(message.replace("\n", " "), f"run '{self.prog} --help' for usage")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="collect_baseline.py",
                description="Collect a recipe's performance baseline from its inference logs.")
    p.add_argument("--log-file", required=True,
                   help="log file, or the RES_PATH directory holding log_{rank}.log")
    p.add_argument("--output", required=True, help="baseline JSON to write")
    p.add_argument("--yaml-file", required=True, help="the recipe's config YAML")
    p.add_argument("--rank", type=int, default=0, help="rank whose log is measured (default 0)")
    p.add_argument("--model-source", default=None,
                   help="model source to record (default: YAML model_source, else model_path)")
    return p


def _fmt_ms(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f} ms"


def main(argv: Optional[list[str]] = None) -> int:
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:  # --help
            return exc.code if isinstance(exc.code, int) else EXIT_OK
        baseline, warnings = collect(args.log_file, args.yaml_file, args.rank, args.model_source)
        out = Path(args.output)
        kept = write_json(out, baseline)
    except CollectError as exc:
        print(exc.line(), file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print(f"{PROG}: error: interrupted — nothing written", file=sys.stderr)
        return 130
    except Exception as exc:  # never a traceback
        msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        print(f"{PROG}: error: unexpected failure ({msg}) — please report it with the log",
              file=sys.stderr)
        return EXIT_UNEXPECTED
    for w in warnings:
        print(f"{PROG}: warning: {w}".replace("\n", " "), file=sys.stderr)
    if kept is not None:
        print(f"{PROG}: kept previous baseline as {kept}")
    perf = baseline["performance"]
    print(f"{PROG}: prefill {_fmt_ms(perf['prefill_ms'])}, decode avg "
          f"{_fmt_ms(perf['decode_avg_ms'])} -> {out}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
