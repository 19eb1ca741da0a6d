"""What a recipe's run log says: its generate calls, their timings and outputs, and which call is
the formal (non-warm-up) one.

The log lines understood are one table, `LINE_FORMATS`: this tool's engine, cann-recipes-infer's
framework mode and legacy/upstream ModelRunner styles. `parse_log_text` splits a log into runs and
generate-call segments; `select_formal` picks the call a baseline measures; `measure` gives its
prefill and decode figures. Used by the baseline collector (agent.measure.baseline) and by the trial-run
verdict (agent.workflow.nodes.judge_run), so both read a log the same way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from engine.safe_load import loads_json_prefix

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
TRACEBACK_RE = re.compile(r"Traceback \(most recent call last\):")
RANK_LOG_RE = re.compile(r"^log_(\d+)\.log$")


@dataclass(frozen=True)
class LineFormat:
    """One kind of log line: what it reports (`kind`), which logger writes it (`style`)."""

    kind: str        # time | output | average | bandwidth | speculation | warmup | environment | traceback
    style: str       # engine (this tool and upstream ModelRunner) | executor (upstream's shared executor) | upstream | any
    pattern: re.Pattern


# First match wins, so a framework line is tried before the engine line it resembles.
LINE_FORMATS = (
    # cann-recipes-infer framework mode (executor/core/scheduler): one line per forward step, logged
    # with "[%(levelname)s][%(asctime)s.%(msecs)03d][%(filename)s:%(lineno)d] %(message)s". The
    # engine warms up inside OfflineInference before the formal call without logging these lines.
    LineFormat("time", "executor", re.compile(
        r"\[Main\] Inference time \((?P<stage>prefill|decode)\): (?P<ms>" + _NUM + r") ms")),
    LineFormat("time", "engine", re.compile(
        r"(?P<model>\S+) inference time cost of (?P<stage>prefill|decode) is (?P<ms>" + _NUM + r") ms")),
    LineFormat("output", "engine", re.compile(r"Request (?P<idx>\d+): outputs: ?(?P<text>.*)$")),
    # Some upstream versions: "Inference decode result for batch 0: \n<text>".
    LineFormat("output", "upstream", re.compile(
        r"Inference decode result for batch (?P<idx>\d+): ?(?P<text>.*)$")),
    LineFormat("average", "executor", re.compile(
        r"(?P<model>\S+) decode average inference time cost is (?P<ms>" + _NUM + r") ms")),
    # Upstream ModelRunner logs this after the decode loop of non-warm-up calls only.
    LineFormat("average", "engine", re.compile(
        r"(?P<model>\S+) average inference time cost is (?P<ms>" + _NUM + r") ms")),
    # Our engine, after the texts: bytes of weights read per decode step / mean decode step time.
    LineFormat("bandwidth", "engine", re.compile(
        r"(?P<model>\S+) decode " + _NUM + r" steps/s x batch \d+, achieved bandwidth (?P<gbps>" + _NUM + r") GB/s")),
    # upstream's executor/offline/infer.py with model_config.next_n > 0 (log_results): the MTP drafts, and how many
    # the main model accepted
    LineFormat("speculation", "executor", re.compile(
        r"the number of valid output tokens is (?P<valid_output_tokens>\d+), total number of draft tokens is "
        r"(?P<draft_tokens>\d+), total accepted number is (?P<accepted_tokens>\d+)")),
    LineFormat("speculation", "executor", re.compile(
        r"The speculation accept (?P<figure>length|rate): (?P<value>" + _NUM + r")")),
    LineFormat("warmup", "engine", re.compile(r"(?P<model>\S+) warm-up run (?P<edge>begins|ends)\b")),
    LineFormat("environment", "engine", re.compile(r"(?P<model>\S+) environment: (?P<json>\{.*)$")),
    LineFormat("traceback", "any", TRACEBACK_RE),
)


def match_line(line: str) -> tuple[Optional[LineFormat], Optional[re.Match]]:
    """The first format of LINE_FORMATS found in ``line``, and its match; (None, None) if none."""
    for fmt in LINE_FORMATS:
        m = fmt.pattern.search(line)
        if m:
            return fmt, m
    return None, None


def is_record_start(line: str) -> bool:
    """True if ``line`` starts a log record (anything else continues the previous one)."""
    if _HEADER_RE.search(line) or _OTHER_START_RE.search(line):
        return True
    return match_line(line)[0] is not None


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
    achieved_bandwidth_gbps: Optional[float] = None  # our engine's "achieved bandwidth X GB/s"
    speculation: dict = field(default_factory=dict)  # upstream's MTP figures (draft / accepted tokens, rate, length)

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


class _LogParser:
    """Reads records in order; one handler per LineFormat kind updates the runs and segments."""

    def __init__(self, path: Path):
        self.parsed = ParsedLog(path, [Run(1)])
        self.seg: Optional[Segment] = None
        self.in_warmup = False

    @property
    def run(self) -> Run:
        return self.parsed.runs[-1]

    def new_run(self, line_no: int) -> Run:
        run = self.run
        if not run.is_empty():
            run = Run(line_no)
            self.parsed.runs.append(run)
        run.line_no = line_no
        return run

    def feed(self, rec: Record) -> None:
        fmt, m = match_line(rec.first)
        if fmt is not None:
            getattr(self, "on_" + fmt.kind)(rec, fmt, m)

    def on_time(self, rec: Record, fmt: LineFormat, m: re.Match) -> None:
        ms = float(m.group("ms"))
        framework = fmt.style == "executor"
        if m.group("stage") == "decode":
            if self.seg is not None:
                self.seg.decode_ms.append(ms)
            else:
                self.parsed.warnings.append(f"{self.parsed.path.name}:{rec.line_no}: decode line "
                                            "without a preceding prefill line ignored")
            return
        seg = self.seg
        if framework and seg is not None and seg.framework and not seg.decode_ms and not seg.outputs:
            return  # another prefill batch of the same call: the first one is measured
        model = m.group("model") if "model" in fmt.pattern.groupindex else ""
        self.seg = Segment(rec.line_no, self.in_warmup, ms, model, framework=framework)
        self.run.segments.append(self.seg)

    def on_output(self, rec: Record, fmt: LineFormat, m: re.Match) -> None:
        if self.seg is None:
            return
        parts = [m.group("text"), *rec.continuation]
        if fmt.style == "upstream" and not parts[0].strip():
            parts = parts[1:]  # the text starts on the next line
        self.seg.outputs.setdefault(int(m.group("idx")), "\n".join(parts).rstrip("\r\n"))

    def on_average(self, rec: Record, fmt: LineFormat, m: re.Match) -> None:
        if self.seg is not None:
            self.seg.has_average = True
            self.seg.reported_average_ms = float(m.group("ms"))

    def on_speculation(self, rec: Record, fmt: LineFormat, m: re.Match) -> None:
        if self.seg is None:
            return
        if "figure" in fmt.pattern.groupindex:
            self.seg.speculation[f"accept_{m.group('figure')}"] = float(m.group("value"))
        else:
            self.seg.speculation.update({key: int(value) for key, value in m.groupdict().items()})

    def on_bandwidth(self, rec: Record, fmt: LineFormat, m: re.Match) -> None:
        if self.seg is not None:
            self.seg.achieved_bandwidth_gbps = float(m.group("gbps"))

    def on_warmup(self, rec: Record, fmt: LineFormat, m: re.Match) -> None:
        self.seg = None
        if m.group("edge") == "begins":
            run = self.run
            if any(not s.warmup for s in run.segments):
                # a formal call already happened: this is a new, appended run
                run = self.new_run(rec.line_no)
            run.has_markers = True
            self.in_warmup = True
        else:
            self.run.has_markers = True
            self.in_warmup = False

    def on_environment(self, rec: Record, fmt: LineFormat, m: re.Match) -> None:
        self.seg = None
        self.in_warmup = False
        run = self.new_run(rec.line_no)
        raw = "\n".join([m.group("json"), *rec.continuation])
        try:
            env, _ = loads_json_prefix(raw, f"{self.parsed.path.name}:{rec.line_no}")
        except ValueError:
            env = None
        if isinstance(env, dict):
            run.env, run.env_line = env, rec.line_no
        else:
            self.parsed.warnings.append(
                f"{self.parsed.path.name}:{rec.line_no}: environment line is not a JSON object; ignored")

    def on_traceback(self, rec: Record, fmt: LineFormat, m: re.Match) -> None:
        self.seg = None
        tail = [ln.strip() for ln in rec.continuation if ln.strip()]
        self.run.tracebacks.append((rec.line_no, tail[-1] if tail else rec.first.strip()))


def parse_log_text(text: str, path: Path | str = "<log>") -> ParsedLog:
    """Split a log into runs and generate-call segments."""
    parser = _LogParser(Path(path))
    for rec in split_records(text):
        parser.feed(rec)
    return parser.parsed


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
