"""A recipe's performance baseline (baseline/baseline_metadata.json) from its inference logs.

Reads the log(s) written by ``bash infer.sh`` (``${RES_PATH}/log_{rank}.log``) with agent.measure.run_log,
takes the formal (non-warm-up) generate call and builds the baseline: prefill = first forward of
the formal call, decode = mean of its decode forwards without the first decode step. Values that
were not measured are ``null``. `collect` builds it, `with_verification` adds what the verify node
found, and `write_baseline` is the one writer of the file (scripts/collect_baseline.py is the CLI).

Expected failures raise CollectError with the exit code the CLI returns: 2 bad input
(missing/unreadable log or YAML, bad arguments); 3 the log has no formal prefill line (the run
failed).
"""

from __future__ import annotations

import copy
import datetime as _dt
import importlib
import importlib.metadata
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Optional

from agent.measure.run_log import RANK_LOG_RE, ParsedLog, measure, parse_log_text, select_formal
from agent.measure.peak_bandwidth import peak_bandwidth_gbps
from agent.recipe.targets import ANY_SCHEMA
from engine.safe_load import load_json, load_yaml as safe_load_yaml
from npu_standin import honest

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


def error_line(exc: Exception) -> str:
    """The one line that reports ``exc``: a CollectError's own, else an unexpected failure."""
    if isinstance(exc, CollectError):
        return exc.line()
    msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return f"{PROG}: error: unexpected failure ({msg}) — please report it with the log"


# --------------------------------------------------------------------------- inputs


def read_log(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise CollectError(f"cannot read log file {path}: {exc.strerror or exc}",
                           "check the path and its permissions") from None


def parse_log_file(path: Path) -> ParsedLog:
    return parse_log_text(read_log(path), path)


def resolve_logs(log_arg: str, rank: int) -> tuple[Path, list[tuple[int, Path]]]:
    """(log of the selected rank, every rank log to check for all_ranks_success)."""
    path = Path(log_arg)
    if path.is_dir():
        ranks = sorted((int(m.group(1)), p) for p in path.iterdir()
                       if (m := RANK_LOG_RE.match(p.name)) and p.is_file())
        chosen = path / f"log_{rank}.log"
        if not chosen.is_file():
            found = ", ".join(p.name for _, p in ranks) or "no log_*.log files"
            raise CollectError(f"log file {chosen} not found (directory has: {found})",
                               "run 'bash infer.sh' first or pass --rank / --log-file correctly")
        return chosen, ranks
    if path.is_file():
        m = RANK_LOG_RE.match(path.name)
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
        data = safe_load_yaml(path)
    except OSError as exc:
        raise CollectError(f"cannot read YAML file {path}: {exc.strerror or exc}",
                           "check its permissions") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None) or getattr(getattr(exc, "syntax", None), "problem_mark", None)
        if mark is None and getattr(exc, "line", None):
            where = f" at line {exc.line}"
        if mark is not None:
            where = f" at line {mark.line + 1}"
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise CollectError(f"cannot parse YAML file {path}{where}: {problem}",
                           "fix the YAML syntax") from None
    if not isinstance(data, dict):
        raise CollectError(f"YAML file {path} is not a mapping of settings",
                           "pass the recipe's config YAML (model_name, model_path, exe_mode, ...)")
    return data


def yaml_settings(cfg: dict) -> dict:
    """The settings a baseline records, from either YAML schema of cann-recipes-infer: the targets'
    one normaliser (agent.recipe.targets.ANY_SCHEMA; the collector reads a YAML without its recipe, so
    the four-section keys win where both are present: they are what the executor reads). ``exe_mode``
    is recorded as written (``eager``, ``ge_graph``, ``npugraph_ex``, or anything else)."""
    settings = ANY_SCHEMA.settings(cfg)
    settings.pop("dataset", None)
    return settings


def yaml_relpath(yaml_arg: str) -> str:
    """Path relative to the recipe dir (parent of the YAML's config/ dir), else as given."""
    path = Path(yaml_arg).resolve()
    for parent in path.parents:
        if parent.name == "config":
            return path.relative_to(parent.parent).as_posix()
    return yaml_arg


# --------------------------------------------------------------------------- engine helpers


def _import_engine(module: str, attr: str) -> Optional[Callable]:
    """``engine.<module>.<attr>``, or None when that module cannot be imported (a broken or
    half-written engine must not stop a collection: the baseline then says what is missing)."""
    try:
        return getattr(importlib.import_module(f"engine.{module}"), attr)
    except Exception:  # ImportError, or a broken/half-written module
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


CANONICAL_NAME = honest.CANONICAL_BASELINE    # a stand-in baseline is named by npu_standin.honest.baseline_file_name


def keep_previous(out: Path, previous_dir: Optional[Path] = None, tree=None) -> Optional[Path]:
    """Move an existing ``out`` to ``<stem>.previous.json`` in ``previous_dir`` (default: beside it),
    replacing the one kept before: one previous baseline is kept, never a growing pile."""
    if not out.exists():
        return None
    folder = previous_dir or out.parent
    tree = tree or _baseline_tree(out, folder)
    tree.mkdir(folder)
    kept = folder / f"{out.stem}.previous{out.suffix}"
    tree.replace(out, kept)
    return kept


def _baseline_tree(out: Path, previous_dir: Optional[Path] = None, recipe_dir: Optional[Path] = None):
    """The tree a baseline is written in: the recipe's when known, else the folder holding both `out`
    and where the previous one is kept (a --output file the user named: its folder)."""
    from engine.safe_write import UserTree

    if recipe_dir is not None:
        return UserTree(recipe_dir, "the recipe")
    return UserTree(os.path.commonpath([os.path.abspath(out.parent), os.path.abspath(previous_dir or out.parent)]),
                    "the baseline's folder", create=True)



# what a baseline records as model_source for a checkpoint of this machine (upstream's checklist: "paths
# use placeholders such as your_model_path, never a real local path")
MODEL_SOURCE_PLACEHOLDER = "your_model_source"
_HF_CACHE_SNAPSHOT = re.compile(r"(?:^|[/\\])models--([^/\\]+?)--([^/\\]+)[/\\]snapshots[/\\]([0-9a-f]{7,64})[/\\]?$")
_LINK = re.compile(r"^[a-z][a-z0-9+.-]*://", re.I)


def public_model_source(source: Optional[str]) -> Optional[str]:
    """model_source as a tracked file may hold it: a hub link or id as given, the hub link of a hub cache's
    snapshot folder, and for any other path of this machine the placeholder (what upstream's checklist
    asks of YAML paths). None stays None."""
    if source is None:
        return None
    text = str(source).strip()
    cached = _HF_CACHE_SNAPSHOT.search(text)
    if cached:
        return f"https://huggingface.co/{cached.group(1)}/{cached.group(2)}/tree/{cached.group(3)}"
    if _LINK.match(text):
        return MODEL_SOURCE_PLACEHOLDER if text.lower().startswith("file:") else text
    if not text or text.startswith(("/", ".", "~", "\\")) or re.match(r"^[A-Za-z]:[\\/]", text) or Path(text).exists():
        return MODEL_SOURCE_PLACEHOLDER
    return text


def write_baseline(out: Path, baseline: dict, previous_dir: Optional[Path] = None,
                   recipe_dir: Optional[Path] = None) -> Optional[Path]:
    """Write ``baseline`` to ``out`` atomically, keeping the previous file (in ``previous_dir``, default
    beside it); returns the kept path. ``recipe_dir``: a recipe this tool wrote, whose README's
    product and performance sections are rewritten from the baseline (agent.recipe.readme).

    The only writer of baseline_metadata.json: the CLI writes what `collect` built, the workflow
    what `with_verification` added to it. Its model_source is never a path of this machine
    (`public_model_source`)."""
    model = baseline.get("model_config")
    if isinstance(model, dict) and model.get("model_source") is not None:
        baseline = {**baseline, "model_config": {**model, "model_source": public_model_source(model["model_source"])}}
    try:
        data = (json.dumps(baseline, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
        tree = _baseline_tree(out, previous_dir, recipe_dir)
        kept = keep_previous(out, previous_dir, tree)
        tree.write_bytes(out, data)

    except OSError as exc:

        raise CollectError(f"cannot write {out}: {exc.strerror or exc}",
                           "check that the output directory is writable") from None
    if recipe_dir is not None:
        refresh_readme(Path(recipe_dir), out, baseline)
    return kept


def refresh_readme(recipe_dir: Path, out: Path, baseline: dict) -> bool:
    """The recipe README's 支持的产品型号 and 性能基线 from the baseline of record: an NPU baseline beside
    a stand-in one stays the README's (a stand-in result never replaces an NPU one)."""
    from agent.recipe import readme

    record, record_path = baseline, out
    canonical = out.with_name(CANONICAL_NAME)
    if out.name != CANONICAL_NAME and canonical.is_file():
        try:
            npu = load_json(canonical)
        except (OSError, ValueError):
            npu = None
        if readme.ran_on_npu(npu):
            record, record_path = npu, canonical
    settings = {}
    if record.get("yaml_path"):
        try:
            settings = load_yaml(str(recipe_dir / record["yaml_path"]))
        except CollectError:
            settings = {}
    try:
        rel = record_path.resolve().relative_to(recipe_dir.resolve()).as_posix()
    except ValueError:
        rel = record_path.name
    return readme.refresh(recipe_dir, record, rel, settings)


def with_verification(baseline: dict, parity: dict) -> dict:
    """A copy of ``baseline`` with the verify node's parity result in ``verification.parity``."""
    baseline = copy.deepcopy(baseline)
    verification = baseline["verification"]
    verification["parity"] = parity
    if parity.get("untrained_weights"):
        # Random weights write noise by design: judging the text would only say so.
        verification["output_check"] = dict(
            verification.get("output_check") or {}, ok=None,
            skipped="untrained weights: text checks skipped" + (", parity used" if parity.get("checked") else ""))
    elif parity.get("empty_output") and (verification.get("output_check") or {}).get("ok") is False:
        # transformers' own greedy text on the same prompt is empty too: no text to judge, the model writes none
        verification["output_check"] = dict(verification["output_check"], ok=None, skipped=parity["empty_output"])
    return baseline


def bandwidth_figures(achieved_gbps: Optional[float], run_env: Optional[dict]) -> dict:
    """The engine's achieved decode bandwidth and its fraction of the device's published peak
    (null when the log has no bandwidth line or the device's peak is not known, e.g. a CPU)."""
    device = (run_env or {}).get("device")
    name = (run_env or {}).get("cuda_device_name" if device == "cuda" else "npu_model") if device != "cpu" else None
    peak = peak_bandwidth_gbps(name)
    fraction = round(achieved_gbps / peak, 4) if achieved_gbps is not None and peak else None
    return {"achieved_bandwidth_gbps": achieved_gbps, "bandwidth_fraction": fraction}


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
        "performance": {"prefill_ms": prefill, "decode_avg_ms": decode_avg, "output_text": text,
                        **bandwidth_figures(seg.achieved_bandwidth_gbps, run_env)},
        "verification": {
            "all_ranks_success": all_ok,
            "output_check": check,
            "parity": None,
            "collection_warnings": warnings,
        },
    }
    if seg.speculation:
        # MTP (next_n > 0): upstream's figures; each decode step verifies next_n drafts per request
        spec = dict(seg.speculation)
        if spec.get("draft_tokens") and "accepted_tokens" in spec:
            spec["accept_rate"] = spec["accepted_tokens"] / spec["draft_tokens"]
        spec["next_n"] = (cfg.get("model_config") or {}).get("next_n") if isinstance(cfg, dict) else None
        baseline["performance"]["speculation"] = spec
    # a run under the npu stand-in says so: host device, no NPU, host timings, its reference kernels
    honest.mark_run_baseline(baseline, [p for _, p in rank_logs] or [log_path], run_env)
    return baseline, warnings
