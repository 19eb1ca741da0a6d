"""One run of a recipe, and its verdict from evidence.

`trial_run` runs what the recipe's target runs (its infer.sh, or the repository's entry point for a
framework recipe) in a subprocess with a timeout and no stdin, keeping the output and the logs under
`.migrator/runs/run_<N>_<label>/`; `judge_run` decides whether it worked from what it left behind,
whatever the script's exit code (upstream's launch ends with `wait`, so it exits 0 when Python crashed).
"""

from __future__ import annotations

import errno
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from agent.child_failure import signal_exit
from agent.errors import describe_fault
from agent.recipe.fs_guard import user_tree
from agent.measure import precision, run_log
from agent.processes import run_tree, stop_leftovers
from agent.progress import trial_run_counter
from agent.records import Run
from agent.recipe.recipe import Recipe, RunPlan
from agent.recipe.targets import state_dir
from agent.repair.failure import summarise_failure
from agent.run import plan as run_plan
from agent.run import standin as run_standin
from engine import defaults
from engine.safe_write import WRITE_ROOT_ENV

# The formal run leaves its prompt logits here for the parity check (engine.generate reads it).
PARITY_DUMP_ENV = "MIGRATOR_PARITY_DUMP"
NO_WARM_UP = "BaselineError: infer.py ran without a warm-up generation"
SUMMARY_CHARS = 300
NO_SPACE = re.compile(r"\[Errno 28\]|No space left on device|database or disk is full")


@dataclass(frozen=True)
class Verdict:
    problem: str | None                # what the evidence says is wrong; None: nothing
    extra: list[str] = field(default_factory=list)   # rank-log tracebacks missing from the output
    no_warm_up: bool = False           # the formal generation ran without a warm-up one before it
    prefills: int = 0                  # prefill lines in log_0.log


def trial_run(recipe: Recipe, label: str, plan: RunPlan | dict | int | None = None, timeout_s: int | None = None,
              python: str | None = None) -> Run:
    """Run the recipe once, as `plan` says (agent.recipe.recipe.RunPlan, or its dict; an int or None:
    agent.run.plan.plan_run of it): its YAML (a copy with the real weights, written again from the
    recipe's YAML first: agent.run.plan.refresh), its ranks, under the npu stand-in when it says so.
    Paths are absolute, so the run never depends on the caller's working directory. `python`: the
    interpreter the recipe runs with (`python3` and $PYTHON of its scripts; default: this one). The
    record names the plan's YAML and world_size; a run that left fewer rank logs than the plan's ranks
    failed."""
    plan = run_plan_of(recipe, plan)
    run_plan.refresh(recipe, plan)
    runs_dir = state_dir(recipe.path) / "runs"
    recipe_tree = user_tree(recipe.path)      # .migrator/ or res/ linked out of the recipe: refused here, first
    recipe_tree.mkdir(runs_dir)
    run_dir = runs_dir / f"run_{len(list(runs_dir.glob('run_*')))}_{label}"
    recipe_tree.mkdir(run_dir, exist_ok=False)
    launch = recipe.launch(plan)
    cwd = launch.cwd or run_dir
    env = dict(os.environ, RES_PATH=str(run_dir), PYTHON=sys.executable, PYTHONUNBUFFERED="1",
               **{PARITY_DUMP_ENV: str(run_dir / "parity_dump.pt"), WRITE_ROOT_ENV: os.path.abspath(recipe.path)},
               **launch.env)
    command = launch.command
    if plan.standin:
        env = run_standin.launch_env(plan.standin, env, run_dir)
    env = precision.probe_env(env, run_dir)       # every step of every rank recorded for the precision check
    if python:
        # first on PATH: upstream's scripts call `python3`; the stand-in's hook is on PYTHONPATH either way
        env["PYTHON"] = python
        env["PATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(python)), env.get("PATH", "")])
    timeout = timeout_s or defaults.TIMEOUT_S
    stop_leftovers(runs_dir / "running.pids", recipe.path)       # a tree a killed migrator left behind
    start, started_at = time.perf_counter(), time.time()
    counter = trial_run_counter(label, lambda: find_logs(run_dir, cwd, started_at, recipe.path),
                                expected_tokens(recipe, plan.yaml))
    with counter, recipe_tree.open(run_dir / "output.txt", "w") as out:
        # No stdin: a prompt (e.g. "run custom code? [y/N]") must fail, not wait forever. The whole
        # tree (torchrun ranks, `&` launches) is stopped on a timeout or a signal, and measured.
        tree = run_tree(command, cwd=cwd, env=env, stdout=out, timeout=timeout,
                        pids_file=runs_dir / "running.pids", pids_root=recipe.path)
        returncode, timed_out = tree.returncode, tree.timed_out
    output = (run_dir / "output.txt").read_text(errors="replace")
    if returncode != 0 and NO_SPACE.search(output):
        # the disk the run writes to is full: nothing a repair can change (one line, exit 74)
        raise describe_fault(errno.ENOSPC, run_dir)
    log_dir = find_logs(run_dir, cwd, started_at, recipe.path)
    verdict = judge_run(output, log_dir, recipe.path, recipe.target.log_style, plan.world_size)
    ran_clean = returncode == 0 and not timed_out
    ok = ran_clean and verdict.problem is None and not verdict.no_warm_up
    evidence = output
    if verdict.extra:
        evidence = output.rstrip("\n") + "\n" + "\n".join(verdict.extra)
    if verdict.no_warm_up and ran_clean:
        # A conclusion, not an error: recorded only when the run shows no real error.
        evidence = evidence.rstrip("\n") + f"\n{NO_WARM_UP} ({verdict.prefills} prefill in log_0.log)\n"
    # a key of the old YAML schema: the executor ignores it silently, so the run is not taken as it is
    old_keys = run_plan.old_schema_keys(recipe, plan.source_yaml) if plan.standin else []
    if old_keys:
        ok, evidence = False, evidence.rstrip("\n") + "\n" + "\n".join(old_keys) + "\n"
    output_file = run_dir / "output.txt"
    if evidence != output:
        output_file = run_dir / "evidence.txt"
        recipe_tree.write_text(output_file, evidence)

    record: Run = {"label": label, "ok": ok, "returncode": returncode, "timed_out": timed_out,
                   "seconds": round(time.perf_counter() - start, 2), "peak_rss_bytes": tree.peak_rss_bytes,
                   "processes": tree.processes, "res_path": str(run_dir),
                   "log_dir": str(log_dir) if log_dir is not None else None, "problem": verdict.problem,
                   "output_file": str(output_file), "yaml": str(plan.yaml), "world_size": plan.world_size,
                   "source_yaml": str(plan.source_yaml or plan.yaml), "repaired_yaml": str(plan.repaired_yaml),
                   "summary": "ok" if ok else old_keys[0] if old_keys and ran_clean else
                   summarise(evidence, recipe, returncode, timed_out, timeout, verdict)}
    if plan.standin and (missing := run_standin.unsupported(run_dir, "" if ok else evidence,
                                                             [p for p in (recipe.repo_root, recipe.path) if p])):
        record["standin_unsupported"] = missing
    return record


def run_plan_of(recipe: Recipe, plan: RunPlan | dict | int | None) -> RunPlan:
    """The RunPlan of a run: as given (a RunPlan or its dict), else agent.run.plan.plan_run(world_size)."""
    if isinstance(plan, RunPlan):
        return plan
    if isinstance(plan, dict):
        return RunPlan.from_dict(plan)
    return run_plan.plan_run(recipe, plan)


def expected_tokens(recipe: Recipe, yaml: Path | None = None) -> int:
    """Tokens one generate call of the run makes at most: the YAML's max_new_tokens (either schema)."""
    try:
        value = int(recipe.target.schema.get(recipe.settings(yaml), "max_new_tokens") or 0)
    except (TypeError, ValueError):
        value = 0
    return value if value > 0 else defaults.MAX_NEW_TOKENS


def summarise(evidence: str, recipe: Recipe, returncode: int | None, timed_out: bool, timeout: int,
              verdict: Verdict) -> str:
    """A failed run in one line: the first real error and where, or what the evidence says."""
    if timed_out:
        return "timed out after %ds" % timeout
    failure = summarise_failure(evidence, roots=[recipe.path, recipe.repo_root])
    summary = failure["error"]
    if failure.get("location"):
        summary += f" (at {failure['location']})"
    elif returncode not in (0, None) and not failure.get("traceback"):
        summary = f"{signal_exit(returncode) or f'exit code {returncode}'}: {summary}"
    elif verdict.problem and not failure.get("traceback") and not verdict.no_warm_up:
        summary = f"{verdict.problem}: {summary}" if summary != "no output" else verdict.problem
    return summary[-SUMMARY_CHARS:]


def find_logs(run_dir: Path, cwd: Path, since: float, recipe_dir: Path | None = None) -> Path | None:
    """The folder with the run's log_{rank}.log: RES_PATH (run_dir) when the recipe honours it,
    else the newest res/<date>/<case>/ the upstream launch wrote under its working directory or the
    recipe folder (function.sh's WORK_DIR: models/<MODEL_DIR>; the checkout's entry point sets RES_PATH itself)."""
    if any(run_dir.glob("log_*.log")):
        return run_dir
    bases = dict.fromkeys(p for p in (run_dir, cwd, recipe_dir) if p is not None)
    found = [p for base in bases for p in base.glob("res/*/*/log_0.log")
             if p.stat().st_mtime >= since - 1]
    return max(found, key=lambda p: p.stat().st_mtime).parent if found else None


def asks_for_warm_up(recipe_dir: Path) -> bool:
    """infer.py asks for a warm-up generation (some runners log nothing while warming up)."""
    infer_py = recipe_dir / "infer.py"
    return infer_py.is_file() and bool(re.search(r"warm_up\s*=\s*True", infer_py.read_text(errors="replace")))


RANK0_SILENT = "rank 0's log log_0.log is empty although the run did not succeed"
_ERROR_LINE = re.compile(r"^\s*\w*(?:Error|Exception)\b.*:", re.M)     # the output says what failed itself


def judge_run(output: str, log_dir: Path | None, recipe_dir: Path, log_style: str = "runner",
              world_size: int = 1) -> Verdict:
    """The verdict from evidence: a traceback in the output or a rank log, a missing formal prefill
    line, a rank that did not finish its formal run, or fewer rank logs than the run's `world_size`
    makes the run failed. `log_style` (the target's): a ModelRunner's ("runner") must warm up first."""
    traceback_re = run_log.TRACEBACK_RE
    problem = "traceback in the output" if traceback_re.search(output) else None
    extra: list[str] = []
    logs = sorted(log_dir.glob("log_*.log")) if log_dir is not None else []
    rank0 = None
    for path in (p for p in logs if run_log.RANK_LOG_RE.match(p.name)):
        text = path.read_text(errors="replace")
        if found := traceback_re.search(text):
            problem = problem or f"traceback in {path.name}"
            block = text[found.start():]
            if block.strip()[:2000] not in output:
                extra.append(f"==> {path.name} <==\n{block}")
        parsed = run_log.parse_log_text(text, path)
        selection = run_log.select_formal(parsed)
        if path.name == "log_0.log":
            rank0 = (parsed, selection)
        elif not selection.success and problem is None:
            problem = f"rank {path.stem.removeprefix('log_')} did not finish its formal run"
    if rank0 is None:
        # no rank-0 log: the output itself may carry the timing lines (a recipe logging to stdout)
        parsed = run_log.parse_log_text(output, "output.txt")
        rank0 = (parsed, run_log.select_formal(parsed))
    parsed, selection = rank0
    silent = log_dir / "log_0.log" if log_dir is not None else None
    if silent is not None and silent.is_file() and not silent.read_text(errors="replace").strip() and problem is None \
            and not _ERROR_LINE.search(output):
        # rank 0's stdout was cut (function.sh tees it; the other ranks write theirs directly)
        problem = f"{RANK0_SILENT} ({silent.stat().st_size} bytes)"
        others = [f"{p.name}: " + ("model run success" if "model run success" in p.read_text(errors="replace")
                                   else "no 'model run success'") for p in logs if p.name != "log_0.log"]
        extra.append(problem + (f"; {'; '.join(others)}" if others else ""))
    ranks = {int(p.stem.removeprefix("log_")) for p in logs if run_log.RANK_LOG_RE.match(p.name)}
    if problem is None and logs and world_size > 1 and not set(range(world_size)) <= ranks:
        missing = sorted(set(range(world_size)) - ranks)
        problem = (f"a {world_size}-rank run without the log of rank(s) {', '.join(map(str, missing))} "
                   f"(log_{{rank}}.log of {len(ranks)} rank(s) only)")
    if problem is None and selection.segment is None:
        problem = "no formal prefill line in log_0.log" if logs else "no log_0.log and no formal prefill line"
    elif problem is None and not selection.success:
        problem = "the formal run did not finish (no 'Request N: outputs:' line)"
    run = selection.run or parsed.runs[-1]
    no_warm_up = (problem is None and log_style == "runner" and not run.warmed_up()
                  and not asks_for_warm_up(recipe_dir))
    return Verdict(problem, extra, no_warm_up, sum(len(r.segments) for r in parsed.runs))
