"""Rules for cann-recipes-infer's own recipes, as people break them (its model-infer-migrator skill's
references/common_issues.md), that a run off an NPU (the npu stand-in) shows:

* `checkout_not_on_pythonpath` (common issue 3): a legacy recipe's infer.sh relies on set_env.sh to
  put the checkout on PYTHONPATH; where it does not, `executor` / `module` / a sibling `models.X` are
  not found. The fix is the skill's: one `export PYTHONPATH=...` line after the sourced scripts.
* `vocab_not_divisible_by_lmhead_tp`: the lm_head is split over `lmhead_tp_size` ranks, which must
  divide the checkpoint's vocab (module.utils.ensure_divisibility). The fix sets it to the largest
  divisor of world_size that divides the vocab (a YAML line edit).

* `yaml_key_of_old_schema`: a framework YAML with a key of the old, flat schema at the top
  (`model_path:` where InferenceConfig reads `model_config.model_path`), which the executor ignores
  silently (agent.recipe.upstream_schema checks it before a stand-in run). The fix moves the line
  into its section (a line edit: its value and comment kept); where the section already has the key
  the top-level one is dead and only reported.

* `rank0_log_empty` (the runtime-debug skill's "rank 0's stdout goes through tee and can be cut"):
  log_0.log is empty while the run did not succeed. Reported, as the skill does (read log_1.log,
  which is not tee'd), with the launch line when it is what cut it: a redirect of rank 0's stdout
  before `| tee` in the checkout's function.sh (or the recipe's own launch), and upstream's form of it.

* `graph_mode_capture_failed` (the graph-mode skill's "eager 正常 → bug 在图模式适配" and its runtime-debug
  skill's "ERR03007 / graph break"): the YAML runs a graph exe_mode and torch.compile failed — dynamo's
  capture (a graph break under fullgraph, a guard it cannot build), its backend (inductor, torchair's GE
  compile) or a recompile limit. Making the capture work is model-infer-graph-mode's job; the recipe
  falls back to eager: exe_mode set to eager with the original in the line's comment (and in the
  round's backup), the note naming the mode and the error.

A models/<name>/models/__init__.py that shadows the namespace (common issue 1) is
agent.repair.rules.files' `models_init_shadows_package`, which applies to these recipes as they are.
Every fix is a line inserted or a value set; the rest of upstream's bytes stay, backed up first.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from agent.recipe.fs_guard import user_tree
from agent.repair.failure import Failure
from agent.repair.rules._util import edit_yaml_line
from agent.repair.rules.rule import Kind, RepairContext, Rule, where_it_failed
from engine.safe_load import load_json

# ---- the checkout is not on PYTHONPATH ------------------------------------------------------
_CHECKOUT_MODULE_MISSING = re.compile(r"No module named '(?P<module>\w+)(?:\.(?P<sub>\w+))?")
_SOURCED = re.compile(r"^\s*(?:source|\.)\s+\S+", re.M)
_CHECKOUT_ON_PATH = re.compile(r"^\s*(?:export\s+)?PYTHONPATH=.*(?:\.\./\.\.|RECIPES_PATH|PARENT_PARENT_DIR)", re.M)
_SCRIPT_PATH = re.compile(r"^\s*(?:export\s+)?(?P<var>SCRIPT_PATH|SCRIPT_DIR)=", re.M)


def _pythonpath_facts(failure: Failure, found: re.Match) -> dict | None:
    recipe = failure.recipe
    infer_sh = failure.recipe_dir / "infer.sh"
    root = recipe.repo_root
    # a recipe whose own infer.sh sources the checkout's launcher (no infer.sh of ours puts it on the path)
    if not (recipe.target.runs_own_infer_sh and recipe.target.inside_checkout) or root is None or not infer_sh.is_file():
        return None
    module, sub = found.group("module"), found.group("sub")
    in_checkout = (root / module).is_dir() and not (failure.recipe_dir / module).is_dir()
    sibling = module == "models" and sub and (root / "models" / sub).is_dir() and \
        not (failure.recipe_dir / "models" / f"{sub}.py").is_file()
    if not (in_checkout or sibling):
        return None
    text = infer_sh.read_text(errors="replace")
    if _CHECKOUT_ON_PATH.search(text) or not _SOURCED.search(text):
        return None
    return {"module": f"{module}.{sub}" if sibling else module,
            "relative": os.path.relpath(root, failure.recipe_dir)}


def _fix_pythonpath(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    infer_sh = failure.recipe_dir / "infer.sh"
    original = infer_sh.read_bytes()
    text = original.decode("utf-8", errors="surrogateescape")
    last = list(_SOURCED.finditer(text))[-1]
    at = text.index("\n", last.end()) + 1 if "\n" in text[last.end():] else len(text)
    defined = _SCRIPT_PATH.search(text[:last.start()])
    here = f"${{{defined.group('var')}}}" if defined else '$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)'
    line = f'export PYTHONPATH="{here}/{facts["relative"]}:${{PYTHONPATH}}"\n'
    user_tree(failure.recipe_dir).write_bytes(infer_sh, (text[:at] + line + text[at:]).encode("utf-8", errors="surrogateescape"))

    number = text[:at].count("\n") + 1
    return (f"infer.sh: {line.strip()} at line {number}, after the sourced scripts (the checkout's "
            f"'{facts['module']}' was not importable)")


# ---- lmhead_tp_size does not divide the vocab -----------------------------------------------
_NOT_DIVISIBLE = re.compile(r"ValueError: (?P<numerator>\d+) is not divisible by (?P<denominator>\d+)")


def _parallel(settings: dict) -> dict:
    return settings.get("parallel_config") if isinstance(settings.get("parallel_config"), dict) else {}


def _vocab_facts(failure: Failure, found: re.Match) -> dict | None:
    settings = failure.settings()
    parallel = _parallel(settings)
    model_config = settings.get("model_config") if isinstance(settings.get("model_config"), dict) else {}
    path = failure.recipe.resolve(model_config.get("model_path") or settings.get("model_path"))
    try:
        config = load_json((path / "config.json")) if path else {}
    except (OSError, ValueError):
        return None
    vocab = (config.get("text_config") or config).get("vocab_size")
    tp = parallel.get("lmhead_tp_size")
    if not isinstance(vocab, int) or not isinstance(tp, int) or vocab != int(found.group("numerator")) \
            or tp != int(found.group("denominator")):
        return None
    world = int(parallel.get("world_size") or tp)
    size = max(d for d in range(1, world + 1) if world % d == 0 and vocab % d == 0)
    return {"vocab": vocab, "lmhead_tp_size": tp, "size": size}


def _fix_vocab(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    note = edit_yaml_line(failure.yaml, "parallel_config", "lmhead_tp_size", facts["size"],
                          root=failure.recipe_dir)
    return f"{note} (vocab {facts['vocab']} is not divisible by lmhead_tp_size {facts['lmhead_tp_size']})"


# ---- a key of the old schema at the top of a framework YAML ------------------------------------
_OLD_KEY = re.compile(r"InferenceConfig ignores the top-level key '(?P<key>\w+)' of (?P<yaml>\S+) \(old schema\): "
                      r"\S+ reads it as (?P<section>\w+)\.")


def _old_key_facts(failure: Failure, found: re.Match) -> dict | None:
    from agent.recipe.upstream_schema import check

    path = failure.recipe_dir / found.group("yaml")
    if not path.is_file() or not any(f"'{found.group('key')}'" in line
                                     for line in check(path, failure.recipe.repo_root)):
        return None
    section = failure.recipe.settings(path).get(found.group("section"))
    return {**found.groupdict(), "path": str(path),
            "already": isinstance(section, dict) and found.group("key") in section}


def _fix_old_key(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    from agent.recipe.textfile import read_source, write_source

    key, section, path = facts["key"], facts["section"], Path(facts["path"])
    if facts["already"]:
        return (f"{facts['yaml']}: the top-level {key!r} is ignored (old schema) and {section}.{key} is set: "
                f"the top-level line is dead; remove it (nothing changed)")
    original = path.read_bytes()
    lines = read_source(path).splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if re.match(rf"{key}\s*:", line))
    end = start + 1
    while end < len(lines) and lines[end].startswith((" ", "\t")):     # a block value: its lines move too
        end += 1
    moved, rest = lines[start:end], lines[:start] + lines[end:]
    header = next((i for i, line in enumerate(rest) if re.match(rf"{section}\s*:", line)), None)
    if header is None:
        rest = rest + ([] if not rest or rest[-1].endswith("\n") else ["\n"]) + [f"{section}:\n"]
        header, indent = len(rest) - 1, "  "
    else:
        child = next((ln for ln in rest[header + 1:] if ln.strip() and not ln.lstrip().startswith("#")), "  ")
        indent = child[:len(child) - len(child.lstrip())] or "  "
    moved = [indent + line if line.strip() else line for line in moved]
    if not moved[-1].endswith("\n"):
        moved[-1] += "\n"
    write_source(path, "".join(rest[:header + 1] + moved + rest[header + 1:]), original,
                 root=failure.recipe_dir)
    return (f"{facts['yaml']}: moved the top-level {key!r} (old schema, ignored by InferenceConfig) into "
            f"{section} (line {header + 2})")


# ---- rank 0's log is empty: its stdout was cut ------------------------------------------------
_RANK0_SILENT = re.compile(r"rank 0's log log_0\.log is empty although the run did not succeed[^\n]*")
_TEE_LINE = re.compile(r"^\s*(?P<cmd>.*)\|\s*tee\s+\S*log_\$\{?LOCAL_RANK\}?\.log.*$", re.M)
_STDOUT_AWAY = re.compile(r"(?<![&2])>\s*(?!&)\S+|&>\s*\S+|>\s*/dev/null")
UPSTREAM_TEE = '"${cmd[@]}" 2>&1 | tee ${WORK_DIR}/${RES_PATH}/log_${LOCAL_RANK}.log &'


def _rank0_facts(failure: Failure, found: re.Match) -> dict | None:
    facts = {"others": found.group(0).partition("; ")[2], "line": None}
    root = failure.recipe.repo_root
    for script in filter(None, [failure.recipe_dir / "infer.sh",
                                root / "executor" / "scripts" / "function.sh" if root else None]):
        text = script.read_text(errors="replace") if script.is_file() else ""
        for tee in _TEE_LINE.finditer(text):
            base = root if root and root in script.parents else failure.recipe_dir
            facts.update(file=script.relative_to(base).as_posix(), number=text[:tee.start()].count("\n") + 1,
                         line=tee.group(0).strip())
            away = _STDOUT_AWAY.search(tee.group("cmd"))
            facts["away"] = away.group(0).strip() if away else None
            return facts
    return None         # no launch line tees rank 0: not upstream's launch, not this rule


def _report_rank0(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    others = f" ({facts['others']})" if facts["others"] else ""
    read = "read log_1.log, which the other ranks write without tee" + others if facts["others"] else \
        "run it again with 2 ranks or read the output of the command itself"
    if facts.get("away"):
        return (f"rank 0's stdout was cut: {facts['file']}:{facts['number']} sends it to "
                f"'{facts['away']}' before `| tee` (`{facts['line']}`); upstream's launch line is "
                f"`{UPSTREAM_TEE}`: restore it; meanwhile {read} (nothing changed)")
    where = f" ({facts['file']}:{facts['number']} tees it)"
    return (f"rank 0's stdout was cut or not flushed{where}: the runtime-debug skill's 'tee 截断'; {read}; "
            "judge the run by its processes and the other ranks' 'model run success' (nothing changed)")


# ---- upstream's launch guard: another infer.py / server.py runs on the host --------------------
# executor/scripts/function.sh check_launch: `pgrep -f "python.*[ /](infer|server)\.py"` finds one and
# the launch exits 1 with this line, before any rank starts (two jobs would share the NPUs).
_LAUNCH_GUARD = re.compile(r"A Python process executing infer\.py or server\.py was detected to be running, "
                           r"and the script was interrupted and exited\.?")
_GUARD_PATTERN = re.compile(r"python.*[ /](infer|server)\.py")


def _other_launches() -> list[str]:
    """`pid N: COMMAND` of each live process the guard's pattern finds (the failed run's own tree has ended)."""
    import os

    import psutil

    mine = {os.getpid()}
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            line = " ".join(proc.info["cmdline"] or [])
        except psutil.Error:
            continue
        if proc.info["pid"] not in mine and _GUARD_PATTERN.search(line):
            found.append(f"pid {proc.info['pid']}: {' '.join(line.split())[:240]}")
    return found


def _launch_guard_facts(failure: Failure, found: re.Match) -> dict:
    return {"others": _other_launches(), "message": found.group(0)}


def _report_launch_guard(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    others = facts["others"]
    who = ("; ".join(others[:3]) + (f" (and {len(others) - 3} more)" if len(others) > 3 else "")) if others else \
        "it has ended since (run `pgrep -af \"python.*[ /](infer|server)\\.py\"` to see one that is back)"
    return (f"upstream's launch guard (check_launch, executor/scripts/function.sh) refused to start: another "
            f"`python … infer.py|server.py` runs on this host, {who}; wait for it to end or stop it, then run "
            "again (nothing changed)")


# ---- graph mode failed: the capture or compile of the decode step ---------------------------------
# dynamo's and inductor's exceptions as a traceback ends in them (torch/_dynamo/exc.py, torch/_inductor/exc.py:
# Unsupported, UserError, TorchRuntimeError, BackendCompilerFailed, FailOnRecompileLimitHit, InductorError, ...),
# and an exception naming torchair's graph error code; a line that only mentions them (a logged graph break, a
# recompile-limit warning after which the frame ran eagerly) is not a failure of the capture.
_GRAPH_FAILED = re.compile(
    r"^(?P<exception>torch\._(?:dynamo|inductor)\.exc\.\w+)(?::[ \t]*(?P<message>[^\n]*))?"
    r"|^(?P<ge>[\w.]*(?:Error|Exception)\b[^\n]*\bERR03007\b[^\n]*)", re.M)
_GRAPH_MODES = ("npugraph_ex", "ge_graph", "graph")
# The code under capture raised an exception of its own (dynamo's "Observed exception": it "may result in an
# error when running in eager" too), or the stand-in refused a kernel in it: eager meets the same, not graph
# mode's to fix.
_OBSERVED = re.compile(r"^torch\._dynamo\.exc\.(?:Observed\w*|Unsupported: Observed exception)")
_STANDIN_REFUSAL = re.compile(r"npu stand-in: \S+ (?:with .* )?has no reference kernel")


def _graph_mode_facts(failure: Failure, found: re.Match) -> dict | None:
    schema = failure.recipe.target.schema
    settings = failure.settings()
    mode = schema.get(settings, "exe_mode")
    if mode not in _GRAPH_MODES or failure.yaml is None or _OBSERVED.match(found.group(0)) \
            or failure.search(_STANDIN_REFUSAL, ("output", "log")):
        return None
    if found.group("exception"):
        error = f"{found.group('exception')}: {found.group('message') or ''}".strip().rstrip(":")
    else:
        error = found.group("ge")
    key = schema.key_for(settings, "exe_mode")
    return {"mode": mode, "error": error.strip()[:300], "where": where_it_failed(failure), "key": key,
            "yaml_name": failure.yaml.name}


def _fix_graph_mode(failure: Failure, facts: dict, ctx: RepairContext) -> str:
    section, _, key = facts["key"].rpartition(".")
    edit_yaml_line(failure.yaml, section or None, key, "eager", root=failure.recipe_dir,
                   comment=f"was {facts['mode']}: its capture failed ({facts['error'][:120]})")
    from agent.recipe.targets import state_dir

    if failure.yaml.resolve().is_relative_to(state_dir(failure.recipe_dir).resolve()):
        kept = f"the run's copy of it, with the {facts['mode']} line in its comment; the recipe's own file untouched"
    else:
        kept = (f"the {facts['mode']} line kept in its comment and in this round's backup; `migrator rollback` "
                "restores it")
    return (f"graph mode ({facts['mode']}) failed: {facts['error']} (at {facts['where']}); the recipe falls back "
            f"to eager: set {facts['key']}: eager in {facts['yaml_name']} ({kept}). Making the capture work is "
            "model-infer-graph-mode's job")


RULES = [
    Rule("graph_mode_capture_failed", _GRAPH_FAILED,
         "graph mode failed: torch.compile could not capture or compile the decode step (a graph break, a guard, "
         "its backend or a recompile limit)",
         _fix_graph_mode, facts=_graph_mode_facts, where=("error", "output", "log"), kind=Kind.YAML),
    Rule("another_launch_running", _LAUNCH_GUARD,
         "upstream's launch guard (check_launch) found another python infer.py / server.py on the host",
         _report_launch_guard, facts=_launch_guard_facts, where=("output",), kind=Kind.REPORT),
    Rule("checkout_not_on_pythonpath", _CHECKOUT_MODULE_MISSING,
         "the recipe's infer.sh does not put the checkout on PYTHONPATH: its shared modules are not found",
         _fix_pythonpath, facts=_pythonpath_facts, where=("output",), kind=Kind.INFER_SH),
    Rule("vocab_not_divisible_by_lmhead_tp", _NOT_DIVISIBLE,
         "the checkpoint's vocab is not divisible by parallel_config.lmhead_tp_size",
         _fix_vocab, facts=_vocab_facts, where=("output",), kind=Kind.YAML),
    Rule("rank0_log_empty", _RANK0_SILENT,
         "rank 0's log is empty although the run did not succeed: its stdout (tee'd by the launch script) was cut",
         _report_rank0, facts=_rank0_facts, where=("output",), kind=Kind.REPORT),
    Rule("yaml_key_of_old_schema", _OLD_KEY,
         "a framework YAML has a key of the old, flat schema at the top, which InferenceConfig ignores silently",
         _fix_old_key, facts=_old_key_facts, where=("output",), kind=Kind.YAML),
]
