"""The workflow's state: what the user asked for, what the nodes found, and the records they made; and
the run options, which travel in the graph's config (LangGraph `configurable`), not in the state.

Nodes return a partial MigrationState (total=False): only the keys they change."""

from __future__ import annotations

import operator
from typing import Annotated, TypedDict

from agent.records import Baseline, Environment, MemoryEstimate, Round, Run, Vendored, Verification
from engine import defaults


def merge_rounds(rounds: list[Round], new: list[Round]) -> list[Round]:
    """The reducer of `rounds`: diagnose opens a round, repair completes it, so a round whose number
    is already there replaces it; any other is appended."""
    merged = list(rounds)
    for item in new:
        at = next((i for i, old in enumerate(merged) if old.get("round") == item.get("round")), None)
        if at is None:
            merged.append(item)
        else:
            merged[at] = item
    return merged


class MigrationState(TypedDict, total=False):
    # inputs
    target: str                 # what the user gave: link, Org/Name, checkpoint dir or recipe dir
    output_dir: str
    name: str | None
    dtype: str | None
    weights: str | None
    trust_remote_code: bool
    allow_install: bool
    max_new_tokens: int
    world_size: int | None      # --world-size: the run's ranks (None: the recipe's own YAML; 1 for a new one)
    transformers_source: str | None   # --transformers-source WHEEL|DIR: the checkout's transformers release
    reference_python: str | None      # --reference-python: the interpreter that has it
    quantize: str | None        # --quantize w8a8: the migration runs the checkpoint written so (agent.migrate.quantize)
    recipe_target: str | None   # the row of agent.recipe.targets.TARGETS a migration writes (--target, else the
                                # output dir's default: agent.workflow.inputs); None for a recipe
    # derived
    env: Environment
    scenario: str               # "A" migrate, "B" repair, "C" baseline
    classify_reason: str
    recipe_dir: str
    model_name: str
    model_dir: str              # local checkpoint directory (with --quantize: the one written)
    quantization: dict          # --quantize: what was written (agent.migrate.quantize.Written) and its cost
                                # (agent.measure.quant_cost), with the float original's folder
    model_source: str           # link or path recorded in the baseline
    conversion: dict            # agent.migrate.convert: a quantized checkpoint converted for the NPU (format, path, command)
    auto_map_note: str          # the source's auto_map is served by transformers' own class (agent.migrate.vendor)
    architecture: str
    family: str
    vendored: Vendored
    transformers: dict          # agent.workflow.nodes.transformers_plan: version, source_root, origin, python
    rendered: list[str]
    native_model: dict          # framework target: the decide_native step's decision, as the report and README say it
                                # (NativeDecision.summary: native, or which kind fell back and why)
    native_source: str          # ... and when native, the file its self-check ran: what render writes
    run_plan: dict              # agent.recipe.recipe.RunPlan.as_dict(): what every trial run, check and record reads;
                                # --standin: the plan the input step made (its `standin` set), else classify's or render's
    # Nodes return only their new items: LangGraph appends runs and merges rounds.
    runs: Annotated[list[Run], operator.add]          # every trial run, in order
    rounds: Annotated[list[Round], merge_rounds]      # repair rounds: diagnosis, diff
    memory: MemoryEstimate
    baseline: Baseline          # collected by collect_baseline; verify adds parity and writes it
    baseline_path: str
    verification: Verification
    status: str                 # "ok" | "failed" | "oom" | ...
    message: str


class RunOptions(TypedDict, total=False):
    """How this invocation runs the graph (the graph's config; `--resume` runs with the options given now)."""
    max_rounds: int             # repair rounds at most
    timeout_s: int | None       # seconds for each run of the recipe (None: engine.defaults.TIMEOUT_S)
    device: str                 # --device: auto, cpu, cuda[:N], npu[:N]


OPTION_KEYS = tuple(RunOptions.__annotations__)


def run_options(config: dict | None) -> RunOptions:
    """The run options of a node's or a route's config, with their defaults."""
    given = (config or {}).get("configurable") or {}
    return {"max_rounds": given.get("max_rounds", defaults.MAX_ROUNDS), "timeout_s": given.get("timeout_s"),
            "device": given.get("device") or "auto"}


SUMMARY_KEYS = ("scenario", "status", "message", "recipe_dir", "model_name", "architecture", "family",
                "baseline_path")


def summarise(state: MigrationState) -> dict:
    """What `migrator run` prints (and --json gives) at the end."""
    summary = {k: state.get(k) for k in SUMMARY_KEYS if state.get(k) is not None}
    parity = (state.get("verification") or {}).get("parity")
    if parity:
        # which check ran, its verdict, and how close the closest step came to its tolerance
        summary["precision"] = {k: parity.get(k) for k in (
            "method", "ok", "checked", "reference", "dtype", "ranks", "requests", "steps_checked",
            "decode_steps_checked", "closest", "routing_ties_taken", "first_failing_step", "first_divergent_layer",
            "reason", "empty_output")
            if parity.get(k) is not None}
    return summary


def standin_run(state: MigrationState) -> bool:
    """A --standin run (of upstream's recipe or ours): its run plan is the stand-in's (agent.run.plan)."""
    return bool((state.get("run_plan") or {}).get("standin"))


def last_run(state: MigrationState) -> Run | dict:
    return (state.get("runs") or [{}])[-1]
