"""The failure catalogue: every rule, in the one order they are tried.

The first rule whose evidence and facts accept a failure takes it, so a specific rule comes before a
general one that would also match. The rules live in one module per kind of fix (code: codemods,
config: YAML edits, files: removals, re-renders and infer.sh edits, reports: advice only); the
optional LLM repairer (agent.repair.llm_repair) comes last: it only sees failures no rule knows.
"""

from __future__ import annotations

from agent.repair import llm_repair
from agent.repair.rules import code, config, files, reports, upstream
from agent.repair.rules.rule import Rule

ORDER = (
    # Out of memory first: any run that ran out of memory goes to the memory estimate, whatever else it printed.
    "out_of_memory",
    # A YAML that does not parse breaks the matchers of later rules, which read it.
    "recipe_yaml_syntax_error",
    "another_launch_running",
    # The recipe's own files and layout: what is missing or shadowed decides what else can be read.
    "models_init_shadows_package",
    "infer_sh_no_pythonpath",
    "checkout_not_on_pythonpath",
    "vendored_module_missing",
    "generated_file_missing_or_corrupt",
    "infer_py_without_warm_up",
    "recipe_file_shadows_stdlib_or_package",
    # upstream's common issues (references/common_issues.md of its model-infer-migrator skill)
    "decode_keeps_prefill_attention_mask",
    "infer_sh_without_repository_root",
    "process_weights_after_loading_missing",
    "per_rank_buffers_sized_by_global_batch",
    "run_timed_out",
    # The YAML's values.
    "dtype_unsupported_on_device",
    "yaml_missing_key",
    "yaml_wrong_type",
    "vocab_not_divisible_by_lmhead_tp",
    "yaml_key_of_old_schema",
    "model_path_missing",
    "lengths_exceed_positions",
    "device_unavailable",
    "yaml_file_missing",
    # torch_npu before missing_pip_package: a missing torch_npu is not a package to install when only
    # incidental calls need it; a torch_npu imported from its source tree is not fixed by guarding it.
    "torch_npu_imported_from_source_tree",
    "incidental_npu_call",
    "torch_npu_backend_autoload_failed",
    "torch_npu_without_cann",
    # Before missing_pip_package: transformers >= 5 falls back to tiktoken when SentencePiece is missing
    # and names tiktoken; the tokenizer needs the library the output names first.
    "tokenizer_backend_missing",
    "constructor_without_runner_settings",
    "forward_unexpected_keyword",
    # Before missing_pip_package: flash_attn is optional, not a package to install.
    "flash_attn_not_installed",
    "missing_pip_package",
    "hardcoded_cuda_device",
    "state_dict_key_mismatch",
    "remote_code_needs_trust",
    "tokenizer_without_pad_token",
    "incidental_cuda_call",
    "shell_script_crlf",
    "shell_script_not_executable",
    "npu_device_id_invalid",
    "npu_device_busy",
    "cann_runtime_init_failed",
    "hccl_init_failed",
    "hccl_collective_timeout",
    "npu_api_version_mismatch",
    "static_tls_libgomp",
    "shared_library_missing",
    "transformers_does_not_know_model",
    "tokenizer_class_unknown",
    "transformers_api_moved",
    "rope_scaling_schema",
    "safetensors_header_invalid",
    "checkpoint_shape_mismatch",
    "meta_tensor_not_loaded",
    "mixed_dtype_in_recipe_code",
    "non_finite_logits",
    "process_group_not_initialized",
    "rendezvous_port_in_use",
    # After every rule that fixes what the capture met (a dtype, a shape, a missing package: the error a
    # dynamo exception wraps): a graph-mode failure none of them explains falls back to eager.
    "graph_mode_capture_failed",
    # last but the LLM: it only says why the evidence is missing
    "rank0_log_empty",
    "llm_repairer",
)


def ordered(rules: list[Rule], order: tuple[str, ...] = ORDER) -> list[Rule]:
    """The rules in `order`; a rule missing from it, or a name without a rule, is a bug."""
    by_name = {rule.name: rule for rule in rules}
    if len(by_name) != len(rules) or set(by_name) != set(order) or len(order) != len(set(order)):
        raise ValueError(f"catalogue order and rules differ: {sorted(set(by_name) ^ set(order))}")
    return [by_name[name] for name in order]


CATALOGUE = ordered([*code.RULES, *config.RULES, *files.RULES, *reports.RULES, *upstream.RULES, llm_repair.RULE])
