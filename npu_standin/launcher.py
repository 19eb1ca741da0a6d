"""Run a command under the stand-in and read back what its processes did.

`run()` refuses where a real torch_npu works (the stand-in never shadows an NPU), builds the
environment (`standin_env`), runs the command as a process tree of its own (agent.processes.run_tree: Ctrl-C
or SIGTERM to the migrator stops the whole tree),
then merges the per-process records of the run into `standin_usage.json` in the record folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from npu_standin import record as _record
from npu_standin.environment import DEVICES, host_problem, probe_real_torch_npu, standin_env
from npu_standin.engine_files import safe_write

UserTree = safe_write.UserTree

USAGE_FILE = "standin_usage.json"
GUARDS_FILE = "guards.log"


class StandinRefused(RuntimeError):
    """The stand-in cannot or must not run here (a working NPU, no CUDA for --device cuda)."""


@dataclass
class StandinRun:
    returncode: int
    usage: dict | None
    record_dir: Path
    elapsed_s: float
    guards: list[str] = field(default_factory=list)

    @property
    def unsupported(self) -> list[dict]:
        return (self.usage or {}).get("unsupported") or []


def check_can_run(device: str) -> None:
    if device not in DEVICES:
        raise StandinRefused(f"--device {device}: the stand-in maps the NPU onto cpu or cuda")
    problem = host_problem(device)
    if problem:
        raise StandinRefused(f"--device {device}: {problem}; use --device cpu")
    real = probe_real_torch_npu()
    if real["status"] == "working":
        raise StandinRefused(f"a working torch_npu is installed here ({real['detail']}): run the command "
                             "directly on the NPU; the stand-in never shadows a real NPU")


def run(command: list[str], device: str = "cpu", record_dir: str | os.PathLike | None = None,
        cwd: str | os.PathLike | None = None, env: dict | None = None, timeout: float | None = None,
        compile_mode: str | None = None, stdout=None, stderr=None, check: bool = True,
        dies_with_caller: bool = False) -> StandinRun:
    """Run `command` under the stand-in on `device`; returns its exit code and merged usage record.

    `record_dir`: where the processes' records go (default: a temporary folder, removed after
    reading). `dies_with_caller`: the command gets SIGTERM when the caller dies, even by SIGKILL
    (`migrator standin`: the user's command never runs on unseen). Raises StandinRefused (see
    check_can_run) before anything runs, FileNotFoundError when the command does not exist."""
    if not command:
        raise ValueError("no command to run")
    if check:
        check_can_run(device)
    keep = record_dir is not None
    from agent.processes import owned_temp    # locked by its owner: one a SIGKILL left is removed later

    # a temporary record folder never outlives the run: removed on an error, Ctrl-C, SIGTERM too
    with contextlib.nullcontext(Path(record_dir)) if keep else owned_temp("npu_standin") as folder:
        return _run_in(folder, keep, command, device, cwd, env, timeout, compile_mode, stdout, stderr,
                       dies_with_caller)


def _run_in(folder: Path, keep: bool, command, device, cwd, env, timeout, compile_mode, stdout, stderr,
            dies_with_caller: bool = False) -> StandinRun:
    from agent.processes import run_tree     # the one way the tool starts a process tree

    record_tree = UserTree(folder, "the stand-in's record folder", create=True)
    for stale in list(folder.glob("standin-*.json")) + [folder / GUARDS_FILE, folder / USAGE_FILE]:
        if stale.is_file():
            record_tree.unlink(stale)
    run_env = standin_env(device, base=env, record_dir=folder)
    if compile_mode:
        run_env["NPU_STANDIN_COMPILE"] = compile_mode
    executable = shutil.which(command[0], path=run_env["PATH"]) if os.sep not in command[0] else command[0]
    if executable is None or not os.path.exists(executable):
        raise FileNotFoundError(f"{command[0]}: command not found")
    # The command is a process tree of its own session: on a timeout, Ctrl-C (which reaches the
    # migrator) or SIGTERM the whole tree is stopped (agent.processes), never left running.
    tree = run_tree([executable, *command[1:]], cwd=Path(cwd) if cwd else None, env=run_env, stdout=stdout,
                    stderr=stderr, stdin=None, timeout=timeout, dies_with_caller=dies_with_caller)
    returncode = 124 if tree.timed_out else tree.returncode
    elapsed = tree.seconds
    usage = _record.read_op_usage(folder)
    guards = []
    if (folder / GUARDS_FILE).is_file():
        guards = list(dict.fromkeys(line.strip() for line in (folder / GUARDS_FILE).read_text().splitlines()
                                    if line.strip()))
    if usage is not None:
        usage["guards"] = guards
        record_tree.write_text(folder / USAGE_FILE, json.dumps(usage, indent=1) + "\n")

    return StandinRun(returncode, usage, folder, elapsed, guards)


def summary_lines(result: StandinRun, device: str) -> list[str]:
    usage = result.usage
    if usage is None:
        return [f"[npu-standin] exit {result.returncode} after {result.elapsed_s:.1f} s: no process activated the "
                "stand-in (no Python process imported torch)"]
    ops = usage.get("ops") or {}
    kernels = ", ".join(f"{name} x{count}" for name, count in ops.items()) or "none"
    ranks = ",".join(str(r) for r in usage.get("ranks") or []) or "-"
    lines = [f"[npu-standin] exit {result.returncode} after {result.elapsed_s:.1f} s (host time, {device}): "
             f"{usage.get('processes', 0)} process(es), ranks {ranks}; reference kernels: {kernels}"]
    for key, entry in sorted((usage.get("compiles") or {}).items()):
        lines.append(f"[npu-standin] compiled {key}: {entry.get('backend')} -> torch.compile/{entry.get('mode')}, "
                     f"{entry.get('compiles', 0)} compile(s), {entry.get('recompiles', 0)} recompile(s)")
    for line in result.guards:
        lines.append(f"[npu-standin] {line}")
    return lines


def first_unsupported(result: StandinRun) -> str | None:
    calls = result.unsupported
    if not calls:
        return None
    names = list(dict.fromkeys(c["name"] for c in calls))
    return (f"{names[0]} has no reference kernel in the npu stand-in (first call at {calls[0]['site']})"
            + (f"; also: {', '.join(names[1:5])}" if len(names) > 1 else ""))


def main_summary(result: StandinRun, device: str) -> None:
    for line in summary_lines(result, device):
        print(line, file=sys.stderr)
