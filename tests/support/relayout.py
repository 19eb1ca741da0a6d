"""Re-apply the test layout of tests/unit/, tests/e2e/, tests/lint/ and tests/support/ (issue #32.5) to a tree
that still has flat test files: a branch cut from main before the layout, merged after it.

    python tests/support/relayout.py            # what it would do
    python tests/support/relayout.py --apply    # do it: git mv, rewrite imports and path mentions

What it does, in order:
1. every tests/test_*.py that is still flat goes where MOVES says (the file the old one was renamed to;
   the parts of a split file are in SPLITS, by name), or, for a file the layout never saw, where PREFIXES
   suggests (printed; moved only with --apply --new);
2. imports of what moved to tests/support/ are rewritten (`from conftest import run_cli` ->
   `from migrator_cli import run_cli`, `from test_framework_target import copy_checkout` ->
   `from upstream_checkout import copy_checkout`, ...): test modules never import one another now;
3. a test file's paths computed from its own place (`Path(__file__).resolve().parent.parent`,
   `...parents[2]`, `Path(__file__).parent / "data"`) become tests/support/locations.py's REPO_ROOT,
   REPO_ROOT.parent, DATA;
4. mentions of old paths (`tests/test_x.py`, `tests/test_x.py::test_name`, `tests/hf_fixture.py`) in
   README.md, docs/, Makefile, pyproject.toml, skills/, scripts/, agent/, engine/, npu_standin/ and tests/ are
   rewritten; a bare mention of a split file is printed, to be checked by hand (its parts went to several
   files).
Edits other branches made to a file that was split land, on merge, in the part git matched the file to
(the MOVES entry); a hunk of a part that moved elsewhere (SPLITS) conflicts and goes there by hand."""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# old file under tests/ -> the file it was renamed to (git mv), relative to tests/
MOVES = {
    'test_acquire.py': 'unit/agent/migrate/test_acquire.py',
    'test_acquire_modelscope.py': 'unit/agent/migrate/test_hub_modelscope.py',
    'test_bad_input.py': 'e2e/test_bad_input.py',
    'test_bad_recipe_input.py': 'e2e/test_bad_recipe_input.py',
    'test_base_model.py': 'e2e/test_base_model.py',
    'test_baseline_batch.py': 'e2e/test_baseline_batch.py',
    'test_bench.py': 'e2e/test_bench.py',
    'test_checkout_recipes.py': 'e2e/test_checkout_recipes.py',
    'test_cli_paths.py': 'e2e/test_cli_paths.py',
    'test_codemod_cache.py': 'unit/agent/migrate/test_codemod_cache.py',
    'test_codemods.py': 'unit/agent/migrate/test_vendor.py',
    'test_codemods_device.py': 'unit/agent/codemods/commands/test_npu_calls_to_device_ops.py',
    'test_collect_baseline.py': 'unit/agent/measure/test_baseline.py',
    'test_coverage.py': 'unit/agent/migrate/test_architecture_coverage.py',
    'test_coverage_remote.py': 'e2e/test_remote_code_shapes.py',
    'test_decode_loop.py': 'unit/engine/test_generate.py',
    'test_demo_cli.py': 'e2e/test_demo_cli.py',
    'test_demo_model.py': 'e2e/test_demo_model.py',
    'test_device_memory.py': 'unit/agent/measure/test_card_memory.py',
    'test_environment.py': 'unit/engine/test_environment.py',
    'test_existing_recipes.py': 'unit/agent/recipe/test_existing_recipes.py',
    'test_families.py': 'e2e/test_families.py',
    'test_fault_classes.py': 'unit/agent/repair/test_fix.py',
    'test_field_commands.py': 'e2e/test_commands_on_upstream_folders.py',
    'test_field_exits.py': 'e2e/test_exits.py',
    'test_field_faults.py': 'unit/agent/repair/test_field_corpus.py',
    'test_field_off_npu.py': 'e2e/test_off_npu.py',
    'test_field_processes.py': 'e2e/test_trial_run_signals.py',
    'test_field_recipes.py': 'e2e/test_recipe_trees.py',
    'test_field_stops.py': 'e2e/test_command_signals.py',
    'test_field_upstream_issues.py': 'unit/agent/repair/rules/test_upstream.py',
    'test_framework_target.py': 'e2e/test_framework_target.py',
    'test_fuzz_inputs.py': 'e2e/test_fuzz_inputs.py',
    'test_graph_mode.py': 'e2e/test_graph_mode.py',
    'test_honest_records.py': 'unit/npu_standin/test_honest.py',
    'test_hostile_values.py': 'unit/agent/recipe/test_render.py',
    'test_hub_refs.py': 'unit/agent/migrate/test_hub_refs.py',
    'test_import_cycles.py': 'lint/test_import_cycles.py',
    'test_legacy_recipe.py': 'e2e/test_legacy_recipe.py',
    'test_llm_repair_protocol.py': 'e2e/test_llm_repair_protocol.py',
    'test_memory.py': 'unit/agent/measure/test_memory.py',
    'test_migrate_e2e.py': 'e2e/test_migrate.py',
    'test_multirank.py': 'e2e/test_multirank.py',
    'test_native_models.py': 'unit/agent/recipe/native/test_native_models.py',
    'test_native_moe.py': 'unit/agent/recipe/native/test_moe_features.py',
    'test_native_mla.py': 'unit/agent/recipe/native/test_mla_features.py',
    'test_new_model_checklist.py': 'unit/agent/recipe/test_checklist.py',
    'test_oom.py': 'e2e/test_oom.py',
    'test_op_table.py': 'e2e/test_op_table.py',
    'test_precision_check.py': 'unit/agent/measure/test_precision.py',
    'test_precision_faults.py': 'e2e/test_precision_faults.py',
    'test_progress.py': 'unit/agent/test_progress.py',
    'test_recipe_requirements.py': 'unit/agent/recipe/test_requirements.py',
    'test_recipe_spec.py': 'unit/agent/recipe/test_spec.py',
    'test_recipe_state.py': 'unit/agent/recipe/test_recipe_state.py',
    'test_remote_code.py': 'e2e/test_remote_code.py',
    'test_remote_fixture.py': 'lint/test_remote_fixture.py',
    'test_repair_code.py': 'unit/agent/repair/rules/test_code.py',
    'test_repair_config.py': 'unit/agent/repair/rules/test_config.py',
    'test_repair_failure.py': 'unit/agent/repair/test_failure.py',
    'test_repair_files.py': 'unit/agent/repair/rules/test_files.py',
    'test_resume_safety.py': 'unit/agent/workflow/test_checkpoint_serde.py',
    'test_rollback_safety.py': 'e2e/test_rollback_safety.py',
    'test_run_plan.py': 'e2e/test_run_plan.py',
    'test_safe_load.py': 'unit/engine/test_safe_load.py',
    'test_safe_write.py': 'unit/engine/test_safe_write.py',
    'test_shrink_parity.py': 'unit/agent/measure/test_parity.py',
    'test_skills.py': 'lint/test_skills.py',
    'test_standin_attention.py': 'unit/npu_standin/kernels/test_attention.py',
    'test_standin_kernels.py': 'unit/npu_standin/kernels/test_reference_kernels.py',
    'test_standin_mla.py': 'unit/npu_standin/kernels/test_mla.py',
    'test_standin_records.py': 'unit/npu_standin/test_record.py',
    'test_standin_runtime.py': 'unit/npu_standin/test_runtime.py',
    'test_standin_scan.py': 'unit/npu_standin/test_scan.py',
    'test_standin_upstream.py': 'e2e/test_upstream_recipes_infer_sh.py',
    'test_targets_as_data.py': 'lint/test_target_names.py',
    'test_tensor_parallel.py': 'e2e/test_tensor_parallel.py',
    'test_transformers_source.py': 'unit/agent/migrate/test_transformers_source.py',
    'test_upstream_check.py': 'e2e/test_upstream_recipes_standin.py',
    'test_upstream_precommit.py': 'e2e/test_upstream_precommit.py',
    'test_upstream_repair.py': 'e2e/test_upstream_repair.py',
    'test_upstream_sweep.py': 'e2e/test_upstream_sweep.py',
    'test_workflow.py': 'e2e/test_scenarios.py',
}
# test helpers, all moved as they were
MOVES.update({f"{name}.py": f"support/{name}.py" for name in ['hf_fixture', 'checkout_fixture', 'field_injections', 'native_moe_harness', 'tp_probe', 'remote_fixture', 'modelscope_fixture']})

# old file -> {top-level name: the file it went to}, for the names that did not stay with the renamed file
SPLITS = {
    'test_acquire.py': {
        'add_snapshot': 'support/hub_cache.py',
        'run_acquire': 'support/hub_cache.py',
        'small_only': 'support/hub_cache.py',
    },
    'test_bad_input.py': {
        'test_table_has_at_least_40_rows': 'lint/test_suite_tables.py',
    },
    'test_codemods.py': {
        'TestAbsoluteImportsCommand': 'unit/agent/codemods/commands/test_absolute_imports.py',
        'TestBlankLineWhitespaceCommand': 'unit/agent/codemods/commands/test_blank_line_whitespace.py',
        'TestPruneUnreachableDefinitionsCommand': 'unit/agent/codemods/commands/test_prune_unreachable_definitions.py',
        'TestRemoveGradientCheckpointingCommand': 'unit/agent/codemods/commands/test_remove_gradient_checkpointing.py',
        'TestRemoveLabelsLossCommand': 'unit/agent/codemods/commands/test_remove_labels_loss.py',
        'TestRunnerSettingsInitCommand': 'unit/agent/codemods/commands/test_runner_settings_init.py',
        'TestSourceHeaderCommand': 'unit/agent/codemods/commands/test_source_header.py',
        'TestTorchNpuImportGuardEnsured': 'unit/agent/codemods/commands/test_torch_npu_guard.py',
        'TestTransformersInitWeightsCommand': 'unit/agent/codemods/commands/test_transformers_init_weights.py',
        'TestVendoredImportsCommand': 'unit/agent/codemods/commands/test_vendored_imports.py',
        'test_driver_error_names_the_command': 'unit/agent/codemods/test_driver.py',
        'test_driver_runs_a_list_in_order_and_names_what_changed': 'unit/agent/codemods/test_driver.py',
        'test_inserted_is_custom_code_leaves_no_whitespace_only_line': 'unit/agent/codemods/commands/test_transformers_init_weights.py',
    },
    'test_codemods_device.py': {
        'TestCudaCallsToDeviceOps': 'unit/agent/codemods/commands/test_cuda_calls_to_device_ops.py',
        'TestGuardTorchNpuImport': 'unit/agent/codemods/commands/test_torch_npu_guard.py',
        'TestNpuDeviceString': 'unit/agent/codemods/commands/test_npu_device_string.py',
        'TestNpuTensorMethod': 'unit/agent/codemods/commands/test_npu_tensor_method.py',
        'TestRopeScalingTypeKey': 'unit/agent/codemods/commands/test_rope_scaling_type_key.py',
        'test_device_ops_keep_npu_behaviour_with_a_faked_npu_backend': 'unit/engine/test_device_ops.py',
        'test_device_ops_on_cpu_are_portable': 'unit/engine/test_device_ops.py',
        'test_npu_kernel_uses_names_kernels_only': 'unit/agent/repair/rules/test_code.py',
    },
    'test_collect_baseline.py': {
        'test_output_check_chinese_passes': 'unit/engine/test_output_check.py',
        'test_output_check_empty_and_length_limits': 'unit/engine/test_output_check.py',
        'test_output_check_normal_english': 'unit/engine/test_output_check.py',
        'test_output_check_random_bytes_fail': 'unit/engine/test_output_check.py',
        'test_output_check_repetitive_fails': 'unit/engine/test_output_check.py',
        'test_output_check_repetitive_without_spaces_fails': 'unit/engine/test_output_check.py',
    },
    'test_coverage.py': {
        'test_runner_asks_the_model_whether_it_builds_its_own_step': 'unit/engine/test_traits.py',
        'test_runner_asks_the_model_whether_it_wants_the_whole_sequence': 'unit/engine/test_traits.py',
        'test_runner_asks_the_model_whether_its_decode_step_takes_the_mask': 'unit/engine/test_traits.py',
    },
    'test_environment.py': {
        'test_every_npu_smi_sample_is_checked': 'lint/test_suite_tables.py',
    },
    'test_families.py': {
        'test_every_family_has_a_case_in_the_default_suite': 'lint/test_suite_tables.py',
        'test_routing_table_detects_families_from_config_features': 'unit/agent/recipe/test_routing.py',
        'test_transformers_range_rows': 'unit/agent/migrate/test_transformers_range.py',
    },
    'test_field_faults.py': {
        '_case': 'e2e/test_field_fault_injections.py',
        'mini_recipe': 'support/mini_recipe.py',
        'test_corpus_has_40_sourced_modes': 'lint/test_suite_tables.py',
        'test_every_corpus_entry_has_an_injection': 'lint/test_suite_tables.py',
        'test_injected_field_fault': 'e2e/test_field_fault_injections.py',
    },
    'test_field_processes.py': {
        '_tagged': 'support/process_tags.py',
    },
    'test_field_upstream_issues.py': {
        'TestAddProcessWeightsAfterLoadingCommand': 'unit/agent/codemods/commands/test_add_process_weights_after_loading.py',
        'TestDecodeAttentionMaskCommand': 'unit/agent/codemods/commands/test_decode_attention_mask.py',
        'TestPerRankBatchSizeCommand': 'unit/agent/codemods/commands/test_per_rank_batch_size.py',
    },
    'test_framework_target.py': {
        '_git': 'support/upstream_checkout.py',
        'check_native_model': 'support/framework_recipes.py',
        'copy_checkout': 'support/upstream_checkout.py',
        'family_checkout': 'support/framework_recipes.py',
        'legacy': 'support/framework_recipes.py',
        'migrate_family': 'support/framework_recipes.py',
        'migrated': 'support/framework_recipes.py',
        'test_default_target_follows_the_output_dir': 'unit/agent/recipe/test_targets.py',
        'test_every_rendered_target_has_its_templates': 'unit/agent/recipe/test_targets.py',
        'two_prompt_yaml': 'support/framework_recipes.py',
    },
    'test_recipe_spec.py': {
        'test_defaults_have_one_home': 'lint/test_one_home.py',
        'test_readme_key_table_is_the_schema': 'lint/test_one_home.py',
    },
    'test_repair_code.py': {
        'TestAddForwardKwargsCommand': 'unit/agent/codemods/commands/test_add_forward_kwargs.py',
        'TestDeviceAgnosticCudaCommand': 'unit/agent/codemods/commands/test_device_agnostic_cuda.py',
        'TestGuardFlashAttnImportCommand': 'unit/agent/codemods/commands/test_guard_optional_import.py',
        'TestPadTokenFallbackCommand': 'unit/agent/codemods/commands/test_pad_token_fallback.py',
        'TestTrustRemoteCodeCommand': 'unit/agent/codemods/commands/test_trust_remote_code.py',
        '_added': 'e2e/test_repair_code_faults.py',
        '_assert_reported_unchanged': 'e2e/test_repair_code_faults.py',
        '_assert_run_repaired': 'e2e/test_repair_code_faults.py',
        '_edit': 'e2e/test_repair_code_faults.py',
        '_model_config': 'e2e/test_repair_code_faults.py',
        '_remote_code_recipe': 'e2e/test_repair_code_faults.py',
        '_snapshot': 'e2e/test_repair_code_faults.py',
        '_tiny_wheel': 'e2e/test_repair_code_faults.py',
        '_yaml_file': 'e2e/test_repair_code_faults.py',
        'test_checkpoint_with_tied_embeddings_gets_config_override': 'e2e/test_repair_code_faults.py',
        'test_forward_without_kwargs_accepts_extra_keywords': 'e2e/test_repair_code_faults.py',
        'test_hardcoded_cuda_is_made_device_agnostic': 'e2e/test_repair_code_faults.py',
        'test_missing_package_is_installed_with_allow_install': 'e2e/test_repair_code_faults.py',
        'test_missing_package_is_reported_with_the_install_line': 'e2e/test_repair_code_faults.py',
        'test_model_init_without_runner_settings_gets_it_back': 'e2e/test_repair_code_faults.py',
        'test_remote_code_with_opt_in_patches_the_call': 'e2e/test_repair_code_faults.py',
        'test_remote_code_without_opt_in_is_reported': 'e2e/test_repair_code_faults.py',
        'test_renamed_base_model_gets_a_key_mapping': 'e2e/test_repair_code_faults.py',
        'test_tokenizer_without_pad_token_falls_back_to_eos': 'e2e/test_repair_code_faults.py',
        'test_unguarded_flash_attn_import_is_guarded': 'e2e/test_repair_code_faults.py',
    },
    'test_repair_config.py': {
        '_inject': 'e2e/test_repair_config_faults.py',
        '_yaml': 'e2e/test_repair_config_faults.py',
        'test_deleted_yaml_is_re_rendered': 'e2e/test_repair_config_faults.py',
        'test_device_this_machine_lacks_is_set_to_auto': 'e2e/test_repair_config_faults.py',
        'test_dtype_alias_bf16_is_mapped_to_bfloat16': 'e2e/test_repair_config_faults.py',
        'test_dtype_the_device_cannot_run_is_set_to_float32': 'e2e/test_repair_config_faults.py',
        'test_hanging_run_is_reported_with_where_it_stopped': 'e2e/test_repair_config_faults.py',
        'test_input_max_len_beyond_the_positions_is_lowered': 'e2e/test_repair_config_faults.py',
        'test_missing_max_new_tokens_is_added_back': 'e2e/test_repair_config_faults.py',
        'test_model_path_missing_never_points_at_a_neighbouring_checkpoint': 'e2e/test_repair_config_faults.py',
        'test_model_path_that_does_not_exist_uses_the_report_s_model_dir': 'e2e/test_repair_config_faults.py',
        'test_quoted_batch_size_is_read_as_int': 'e2e/test_repair_config_faults.py',
    },
    'test_repair_failure.py': {
        'TestInsertWarmUpCommand': 'unit/agent/codemods/commands/test_insert_warm_up.py',
        'test_no_import_cycle_between_repair_modules': 'lint/test_import_cycles.py',
    },
    'test_repair_files.py': {
        '_compiles': 'e2e/test_repair_files_faults.py',
        'test_deleted_model_setting_is_re_rendered': 'e2e/test_repair_files_faults.py',
        'test_deleted_vendored_modeling_file_is_re_vendored': 'e2e/test_repair_files_faults.py',
        'test_infer_py_without_warm_up_gets_it_inserted': 'e2e/test_repair_files_faults.py',
        'test_infer_sh_without_pythonpath_gets_the_export_back': 'e2e/test_repair_files_faults.py',
        'test_models_init_shadowing_the_package_is_removed': 'e2e/test_repair_files_faults.py',
        'test_rollback_after_a_repair_restores_the_injected_files': 'e2e/test_repair_files_faults.py',
        'test_stray_yaml_py_shadowing_pyyaml_is_moved_aside': 'e2e/test_repair_files_faults.py',
        'test_truncated_infer_py_is_re_rendered': 'e2e/test_repair_files_faults.py',
    },
    'test_safe_load.py': {
        '_direct_loads': 'lint/test_loads_through_safe_load.py',
        'test_no_direct_yaml_or_json_load_outside_the_loader': 'lint/test_loads_through_safe_load.py',
        'test_the_engine_loader_needs_nothing_from_agent': 'lint/test_loads_through_safe_load.py',
        'test_the_walk_finds_every_spelling': 'lint/test_loads_through_safe_load.py',
        'yaml_docs': 'support/fuzz_strategies.py',
    },
    'test_safe_write.py': {
        '_all_writes': 'lint/test_writes_through_safe_write.py',
        '_code_files': 'lint/test_writes_through_safe_write.py',
        '_flag_names': 'lint/test_writes_through_safe_write.py',
        '_is_tree': 'lint/test_writes_through_safe_write.py',
        '_key': 'lint/test_writes_through_safe_write.py',
        '_method_open_mode': 'lint/test_writes_through_safe_write.py',
        '_mode': 'lint/test_writes_through_safe_write.py',
        '_writes_mode': 'lint/test_writes_through_safe_write.py',
        'direct_writes': 'lint/test_writes_through_safe_write.py',
        'test_every_allowed_entry_still_writes': 'lint/test_writes_through_safe_write.py',
        'test_no_direct_write_outside_the_writer': 'lint/test_writes_through_safe_write.py',
        'test_the_engine_writer_needs_nothing_from_agent': 'lint/test_writes_through_safe_write.py',
        'test_the_walk_finds_every_spelling': 'lint/test_writes_through_safe_write.py',
    },
    'test_shrink_parity.py': {
        'test_a_layer_cut_the_config_rejects_falls_back_to_widths_only': 'unit/agent/recipe/test_shrink.py',
        'test_shrink_keeps_every_layer_kind_and_mha': 'unit/agent/recipe/test_shrink.py',
        'test_shrink_keeps_partial_rotary_inside_the_heads': 'unit/agent/recipe/test_shrink.py',
        'test_shrink_keeps_structure_and_only_reduces': 'unit/agent/recipe/test_shrink.py',
        'test_shrink_moe_and_mla': 'unit/agent/recipe/test_shrink.py',
    },
    'test_targets_as_data.py': {
        'test_a_folder_that_is_no_recipe_gets_the_not_a_recipe_row': 'unit/agent/recipe/test_targets.py',
        'test_each_row_answers_what_differs_by_target': 'unit/agent/recipe/test_targets.py',
        'test_the_launch_line_a_person_is_told_is_the_targets_own': 'unit/agent/recipe/test_targets.py',
    },
    'test_transformers_source.py': {
        'test_a_recipe_vendored_from_the_checkouts_5_0_runs_on_5_0_under_upstreams_infer_sh': 'e2e/test_recipe_on_transformers_5_0.py',
        'test_bad_transformers_source_on_the_command_line_is_one_line_and_exit_10': 'e2e/test_recipe_on_transformers_5_0.py',
        'test_migrator_run_with_5_24_installed_runs_and_checks_the_recipe_on_5_0': 'e2e/test_recipe_on_transformers_5_0.py',
        'tf50_site': 'support/transformers_5_0.py',
    },
    'test_upstream_check.py': {
        'copy_snapshot': 'support/upstream_checkout.py',
        'run_standin': 'support/upstream_checkout.py',
    },
    'test_workflow.py': {
        '_round': 'unit/agent/workflow/test_graph.py',
        '_state_with_run': 'unit/agent/workflow/test_graph.py',
        'test_after_diagnose_counts_rounds_and_stops_on_repeats': 'unit/agent/workflow/test_graph.py',
        'test_after_repair_reruns_only_when_something_changed': 'unit/agent/workflow/test_graph.py',
        'test_after_trial_run_routes_success_failure_and_oom': 'unit/agent/workflow/test_graph.py',
        'test_classify_node_alone_gives_a_for_a_checkpoint': 'unit/agent/workflow/test_nodes.py',
        'test_every_node_lives_in_agent_nodes_and_is_added_as_is': 'lint/test_one_home.py',
        'test_graph_has_the_nodes_and_edges_of_the_spec': 'unit/agent/workflow/test_graph.py',
        'test_runs_and_rounds_are_reduced_from_the_new_items_nodes_return': 'unit/agent/workflow/test_graph.py',
        'test_the_input_step_gives_the_state_and_the_run_options_apart': 'unit/agent/workflow/test_inputs.py',
        'test_the_input_step_refuses_a_target_kind_the_output_dir_cannot_hold': 'unit/agent/workflow/test_inputs.py',
    },
}

# module a name used to be imported from -> {name: the module under tests/support/ that defines it now}
SUPPORT = {
    'conftest': {
        'REPO_ROOT': 'locations',
        'assert_repaired': 'migrator_cli',
        'assert_round_backup': 'migrator_cli',
        'first_match_name': 'migrator_cli',
        'repair_run': 'migrator_cli',
        'run_cli': 'migrator_cli',
        'torch_npu_wheel': 'npu_wheel',
    },
    'test_framework_target': {
        'FAMILIES': 'framework_recipes',
        'FORBIDDEN_RUNTIME': 'framework_recipes',
        'INSTALLED': 'framework_recipes',
        'MAX_NEW_TOKENS': 'framework_recipes',
        'PROMPTS': 'framework_recipes',
        'SNAPSHOT': 'upstream_checkout',
        '_git': 'upstream_checkout',
        'check_native_model': 'framework_recipes',
        'copy_checkout': 'upstream_checkout',
        'family_checkout': 'framework_recipes',
        'legacy': 'framework_recipes',
        'migrate_family': 'framework_recipes',
        'migrated': 'framework_recipes',
        'two_prompt_yaml': 'framework_recipes',
    },
    'test_upstream_check': {
        'FAST': 'upstream_checkout',
        'copy_snapshot': 'upstream_checkout',
        'run_standin': 'upstream_checkout',
    },
    'test_acquire': {
        'MAIN': 'hub_cache',
        'SCRIPT': 'hub_cache',
        'add_snapshot': 'hub_cache',
        'run_acquire': 'hub_cache',
        'small_only': 'hub_cache',
    },
    'test_hub_refs': {
        'PIECES': 'fuzz_strategies',
    },
    'test_safe_load': {
        'SCALARS': 'fuzz_strategies',
        'yaml_docs': 'fuzz_strategies',
    },
    'test_transformers_source': {
        'TF50_PYTHON': 'transformers_5_0',
        'tf50_site': 'transformers_5_0',
    },
    'test_field_processes': {
        '_tagged': 'process_tags',
    },
}
SUPPORT["tests.conftest"] = SUPPORT["conftest"]
RENAMED_MODULES = {f"tests.{name}": name for name in ['hf_fixture', 'checkout_fixture', 'field_injections', 'native_moe_harness', 'tp_probe', 'remote_fixture', 'modelscope_fixture']}

# where a test file the layout never saw probably goes (first match); anything else is placed by hand
PREFIXES = [
    ("test_native_", "unit/agent/recipe/native/test_"),
    ("test_standin_", "unit/npu_standin/test_"),
    ("test_precision_", "unit/agent/measure/test_precision_"),
    ("test_repair_", "unit/agent/repair/test_"),
    ("test_upstream_", "e2e/test_upstream_"),
    ("test_field_", "e2e/test_"),
]


def destination(name: str) -> tuple[str | None, bool]:
    """(new path under tests/, known) for a flat test file's name."""
    if name in MOVES:
        return MOVES[name], True
    for prefix, new in PREFIXES:
        if name.startswith(prefix):
            return new + name[len(prefix):], False
    return None, False


IMPORT = re.compile(r"^(?P<indent>[ \t]*)from (?P<module>[\w.]+) import (?P<names>\([^)]*\)|[^\n#]*?)"
                    r"(?P<comment>[ \t]*#[^\n]*)?$", re.M)


def rewrite_imports(text: str, where: str) -> str:
    def repl(m: re.Match) -> str:
        module = m["module"]
        if module in RENAMED_MODULES:
            return f"{m['indent']}from {RENAMED_MODULES[module]} import {m['names']}{m['comment'] or ''}"
        if module not in SUPPORT:
            return m[0]
        inner = m["names"].strip("()")
        comments = re.findall(r"#[^\n]*", inner)
        names = [n.strip() for n in re.sub(r"#[^\n]*", "", inner).replace("\n", " ").split(",") if n.strip()]
        by: dict[str, list[str]] = {}
        for name in names:
            target = SUPPORT[module].get(name.split(" as ")[0].strip())
            if target is None:
                print(f"{where}: {module}.{name} is not in tests/support/: move it there by hand")
                return m[0]
            by.setdefault(target, []).append(name)
        comment = m["comment"] or ("  " + comments[0] if comments else "")
        return "\n".join(f"{m['indent']}from {t} import {', '.join(ns)}{comment}" for t, ns in sorted(by.items()))
    return IMPORT.sub(repl, text)


ROOT_EXPR = re.compile(r"Path\(__file__\)\.resolve\(\)\.(?:parent\.parent|parents\[1\])(?![\w.\[])")
ABOVE_EXPR = re.compile(r"(?:\w+\.)?Path\(__file__\)\.resolve\(\)\.parents\[2\](?![\w.\[])")
DATA_EXPR = re.compile(r"Path\(__file__\)(?:\.resolve\(\))?\.parent / \"data\"")


def add_import(text: str, line: str) -> str:
    """`line` after the first block of imports (after the docstring)."""
    if line in text:
        return text
    last = 0
    for node in ast.parse(text).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            last = node.end_lineno
        elif last or not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            break
    lines = text.splitlines(keepends=True)
    lines.insert(last, line + "\n")
    return "".join(lines)


def rewrite_own_paths(text: str) -> str:
    new = DATA_EXPR.sub("DATA", ROOT_EXPR.sub("REPO_ROOT", ABOVE_EXPR.sub("REPO_ROOT.parent", text)))
    new = re.sub(r"^REPO_ROOT = REPO_ROOT\n", "", new, flags=re.M)
    names = [n for n in ("REPO_ROOT", "DATA") if re.search(rf"\b{n}\b", new)
             and not re.search(rf"^{n} = ", new, re.M) and not re.search(rf"^from locations import .*\b{n}\b", new, re.M)]
    if new != text and names:
        new = add_import(new, f"from locations import {', '.join(names)}")
    return new


MENTION = re.compile(r"\btests/(?P<file>\w+\.py)(?:::(?P<test>\w+))?")


def rewrite_mentions(text: str, where: str) -> str:
    def repl(m: re.Match) -> str:
        name, test = m["file"], m["test"]
        if name in SPLITS and test and test in SPLITS[name]:
            return f"tests/{SPLITS[name][test]}::{test}"
        new, known = destination(name)
        if not known:
            return m[0]
        if name in SPLITS and not test:
            print(f"{where}: a bare mention of tests/{name}, split: now tests/{new} (check it names the right part)")
        return f"tests/{new}" + (f"::{test}" if test else "")
    return MENTION.sub(repl, text)


MENTIONED_IN = ["README.md", "docs", "Makefile", "pyproject.toml", "skills", "scripts", "agent", "engine", "npu_standin", "tests"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--apply", action="store_true", help="make the changes (default: print them)")
    parser.add_argument("--new", action="store_true", help="with --apply: also move files PREFIXES places")
    args = parser.parse_args()
    tests = ROOT / "tests"
    moved: set[Path] = set()         # the files this run moves: their paths from their own place are stale
    for path in sorted(tests.glob("*.py")):
        if path.name == "conftest.py":
            continue
        new, known = destination(path.name)
        if new is None:
            print(f"tests/{path.name}: not in the layout: place it under tests/unit/<package>/, tests/e2e/ or tests/lint/")
            continue
        print(f"tests/{path.name} -> tests/{new}" + ("" if known else "   (suggested)"))
        if args.apply and (known or args.new):
            (tests / new).parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["git", "mv", str(path), str(tests / new)], cwd=ROOT, check=True)
        moved.add((tests / new) if args.apply and (known or args.new) else path)
    files = [p for entry in MENTIONED_IN for p in ([ROOT / entry] if (ROOT / entry).is_file() else
                                                    sorted((ROOT / entry).rglob("*")))
             if p.is_file() and p.suffix in (".py", ".md", ".j2", ".json", ".toml", ".yaml", "") and "__pycache__" not in p.parts
             and p != Path(__file__).resolve()]
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        try:
            old = path.read_text()
        except UnicodeDecodeError:
            continue
        new = rewrite_mentions(old, rel)
        if rel.startswith("tests/") and path.suffix == ".py":
            new = rewrite_imports(new, rel)
            if path in moved:                    # its own place is no longer tests/
                new = rewrite_own_paths(new)
        if new != old:
            print(f"rewrite {rel}")
            if args.apply:
                path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
