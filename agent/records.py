"""The records that flow through the workflow graph, into the --resume store and the report.

They are TypedDicts, not classes: the graph's state is plain JSON data, so the checkpoint store's
allow-list serializer (agent.workflow.checkpoint_serde) stores them as they are and never builds
an object from what a store says; a store written by an earlier release reads the same. The
types say what each record holds; agent.workflow.run checks a resumed store against them.
"""

from __future__ import annotations

from typing import Any, TypedDict

from typing_extensions import NotRequired

from engine.environment import Environment


class Vendored(TypedDict, total=False):
    """The vendored model and configuration classes (agent.migrate.vendor.ModelSource.vendored)."""
    model_class: str
    config_class: str
    modeling_module: str
    configuration_module: str
    origin: str                           # "transformers <version>" or "remote code"
    transformers_version: str             # the release the recipe pins (the checkout's, when it has one)
    attn_implementation: str
    auto_map_note: str                    # the repo ships code (auto_map) transformers' own class serves
    text_decoder_note: str                # an image-text checkpoint: served by its text decoder, what is not served
    files: dict[str, str]                 # role -> recipe-relative path
    codemods: dict[str, list[str]]        # file name -> codemods applied


class Run(TypedDict):
    """One run of the recipe (agent.run.trial_run)."""
    label: str                            # classify | trial<N> | verify
    ok: bool
    returncode: int | None                # None: timed out
    timed_out: bool
    seconds: float
    res_path: str                         # the run's folder: output, logs, parity dump
    log_dir: str | None                   # where its log_{rank}.log are
    problem: str | None                   # what the evidence says is wrong, if anything
    output_file: str                      # output.txt, or evidence.txt with rank-log tracebacks added
    summary: str                          # "ok", or the first real error
    yaml: NotRequired[str | None]         # the YAML it ran (not in stores of earlier releases)
    source_yaml: NotRequired[str]         # the recipe's YAML `yaml` is a copy of (RunPlan.source_yaml)
    repaired_yaml: NotRequired[str]       # the YAML a repair of it edits (agent.recipe.recipe.RunPlan.repaired_yaml)
    peak_rss_bytes: NotRequired[int]      # peak summed RSS over the run's whole process tree
    processes: NotRequired[int]           # how many processes the tree had at most
    standin_unsupported: NotRequired[str]  # under the npu stand-in: the op without a reference kernel it hit


class Diagnosis(TypedDict, total=False):
    """What a failed run is (agent.repair.diagnose): the rule that matched, or what is known."""
    signature: str                        # the error without numbers: the same failure across rounds
    error: str
    location: str | None
    oom: bool                             # the out-of-memory rule matched
    rule: str | None
    facts: dict[str, Any]                 # what the rule's fix needs
    diagnosis: str                        # one line
    # a failure no rule knows
    exception: str
    message: str
    last_lines: list[str]
    closest_rule: str | None


class Round(TypedDict, total=False):
    """One repair round: diagnose opens it, repair completes it."""
    round: int
    diagnosis: Diagnosis
    applied: bool                         # the fix changed a file
    rule: str
    kind: str                             # agent.repair.rules.rule.Kind value
    diff: str                             # unified diff against the round's backup
    note: str
    backup: str                           # recipe-relative backup folder
    backup_bytes: int                     # what the round copied (copy-on-write: the files it changed)


class RankEstimate(TypedDict):
    weights_bytes: int
    kv_cache_bytes: int
    needed_bytes: int
    fits: bool | None                     # None: the device's memory is not known


class MemoryEstimate(TypedDict, total=False):
    """Memory per rank after an out-of-memory run (agent.measure.memory)."""
    weights_bytes: int
    kv_cache_bytes: int
    runtime_bytes: int
    needed_bytes: int
    needed_gib: float
    device: str
    device_bytes: int | None
    batch_size: int
    seq_len: int
    dtype: str
    tp_sharded_bytes: int | None          # None: the model has no tensor-parallel plan
    per_rank: dict[int, RankEstimate]     # tensor-parallel size -> per-rank figures
    cards_needed: int | None
    suggested_world_size: int | None
    model_type: str | None
    device_memory_source: str | None      # what device_bytes was read from (agent.measure.memory.card_memory)
    device_memory_fallback: str | None    # why accelerate's answer was not used; None: it was
    multicard_yaml: str                   # the N-card YAML written, recipe-relative
    multicard_command: str


class Verification(TypedDict, total=False):
    all_ranks_success: bool
    output_check: dict[str, Any] | None   # engine.output_check.check_output_text
    parity: dict[str, Any] | None         # agent.measure.parity.check
    collection_warnings: list[str]


class Baseline(TypedDict):
    """baseline_metadata.json (SPEC §3)."""
    timestamp: str
    yaml_path: str
    environment: dict[str, Any]
    model_config: dict[str, Any]
    performance: dict[str, Any]
    verification: Verification


class Report(TypedDict, total=False):
    """migration_report.json: the run's scenario, what it found and made, its rounds and verdict."""
    generated_at: str
    scenario: str
    classify_reason: str
    status: str
    message: str
    model_name: str
    model_source: str
    model_dir: str
    architecture: str
    family: str
    vendored: Vendored
    rendered: list[str]
    native_model: dict[str, Any]
    env: Environment
    runs: list[Run]
    rounds: list[Round]
    memory: MemoryEstimate
    baseline_path: str
    verification: Verification
    quantization: dict[str, Any]     # --quantize: agent.migrate.quantize.for_migration
