"""The test budget (#32.6): default cases moved to `slow` to keep `make test` near 20 minutes on 2 cores,
each with the default case that still runs its path. Node ids as pytest prints them (a prefix matches
every parameter). Measured: `pytest -n 2 --dist loadscope --durations=120` here, 2026-12-02, 1902 s before."""

SLOW_FOR_BUDGET = {
    "tests/e2e/test_run_plan.py::test_world_size_2_on_an_existing_framework_recipe_runs_2_ranks_and_its_records_say_so":
        "tests/e2e/test_tensor_parallel.py (2 ranks) and the run plan's unit tests",
    "tests/unit/agent/migrate/test_hub_modelscope.py::test_modelscope_id_and_link_migrate_end_to_end_offline":
        "tests/unit/agent/migrate/test_acquire.py::test_hub_link_migrates_end_to_end_offline (the hub path end to end)",
    "tests/e2e/test_trial_run_signals.py::test_killed_after_render_then_the_same_command_keeps_the_saved_run_and_resume_works":
        "tests/e2e/test_trial_run_signals.py::test_a_timeout_stops_the_whole_tree and the resume-safety unit tests",
    "tests/e2e/test_trial_run_signals.py::test_two_identical_migrations_at_once_the_second_is_refused":
        "tests/e2e/test_command_signals.py::test_two_migrations_into_one_recipe_folder_the_second_is_refused",
    "tests/e2e/test_trial_run_signals.py::test_peak_rss_is_summed_over_the_tree":
        "tests/unit/agent/measure/test_memory.py",
    "tests/e2e/test_baseline_batch.py::test_baseline_over_several_recipes_writes_the_table":
        "tests/e2e/test_scenarios.py::test_scenario_c_recollects_baseline_and_keeps_the_previous_one",
    "tests/e2e/test_command_signals.py::test_two_migrations_into_one_recipe_folder_the_second_is_refused[same_checkpoint_other_options_via_a_link]":
        "its [other_checkpoint_same_name] case (the folder lock)",
    "tests/e2e/test_command_signals.py::test_rollback_and_baseline_wait_for_the_run_that_holds_the_recipe[symlink]":
        "its [real_path] case",
    "tests/e2e/test_command_signals.py::test_interrupted_verify_leaves_no_parity_folder":
        "tests/e2e/test_command_signals.py::test_the_temp_folder_of_a_sigkilled_migrators_tree_is_removed_by_the_next_command",
    "tests/e2e/test_repair_config_faults.py::test_model_path_that_does_not_exist_uses_the_report_s_model_dir":
        "tests/e2e/test_repair_config_faults.py::test_model_path_missing_never_points_at_a_neighbouring_checkpoint",
    "tests/e2e/test_recipe_trees.py::test_a_round_backs_up_what_it_changes_not_the_whole_recipe":
        "tests/e2e/test_repair_files_faults.py::test_rollback_after_a_repair_restores_the_injected_files",
    "tests/e2e/test_oom.py::test_simulated_card_too_small_for_the_weights_then_the_2card_yaml_runs_tensor_parallel":
        "tests/unit/agent/measure/test_card_memory.py and tests/e2e/test_tensor_parallel.py",
    "tests/e2e/test_field_fault_injections.py::test_injected_field_fault[real-ours-infer-sh-crlf]":
        "tests/e2e/test_recipe_trees.py::test_a_yaml_formatting_slip_the_diagnosis_names_is_fixed",
    "tests/e2e/test_field_fault_injections.py::test_injected_field_fault[real-upstream-npu-module-missing-with-npu-calls]":
        "tests/e2e/test_recipe_trees.py::test_a_bare_npu_import_is_guarded_on_a_host_without_npu",
    "tests/unit/agent/workflow/test_checkpoint_serde.py::test_unreadable_store_is_one_line_exit_2[not_sqlite]":
        "its [threads_not_json] case",
    "tests/unit/agent/workflow/test_checkpoint_serde.py::test_unreadable_store_is_one_line_exit_2[wrong_state_type]":
        "its [threads_not_json] case",
    "tests/unit/agent/workflow/test_checkpoint_serde.py::test_unreadable_store_is_one_line_exit_2[wrong_record_type]":
        "its [threads_not_json] case",
    "tests/e2e/test_llm_repair_protocol.py::test_protocol_key_is_not_inherited_and_an_echoed_key_is_refused":
        "tests/e2e/test_llm_repair_protocol.py::test_protocol_llm_diff_repairs_an_unknown_failure and the LLM client's unit tests",
    "tests/e2e/test_llm_repair_protocol.py::test_protocol_llm_diff_is_a_proposal_by_default":
        "tests/e2e/test_llm_repair_protocol.py::test_protocol_llm_diff_repairs_an_unknown_failure",
    "tests/e2e/test_command_signals.py::test_a_signal_to_standin_stops_its_whole_command_tree[grandchild_in_background-2-130-interrupted]":
        "its [grandchild_in_background-15-143-terminated (SIGTERM)] and [python_child_ignoring_sigint-2-130-interrupted] cases",
    "tests/e2e/test_command_signals.py::test_a_signal_to_standin_stops_its_whole_command_tree[python_child_ignoring_sigint-15-143-terminated (SIGTERM)]":
        "its [grandchild_in_background-15-143-terminated (SIGTERM)] case and tests/unit/agent/test_processes.py",
    "tests/e2e/test_exits.py::test_disk_full_is_one_line_and_a_rerun_works":
        "the filesystem-fault rows of tests/e2e/test_bad_input.py",
}


def slow_for_budget(nodeid: str) -> str | None:
    return next((why for prefix, why in SLOW_FOR_BUDGET.items() if nodeid == prefix or nodeid.startswith(prefix + "[")), None)
