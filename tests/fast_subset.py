"""`make test-fast`: one quick, real test per shardwise package (the contributor's inner loop).

Each entry names tests by pytest id relative to tests/ (a parametrized test's id without its
``[...]`` takes every case). tests/conftest.py marks these ``fast``; under ``-m fast`` it collects
only their files and refuses an entry that names no collected test, so a renamed test cannot drop
out of the subset silently. tests/test_fast_subset.py checks that every package has an entry.
The whole suite (`make test`) stays what CI runs; this subset only catches the obvious early.
"""

from __future__ import annotations

FAST: dict[str, list[str]] = {
    "aio": ["test_aio.py::test_round_trip_direct_and_fallback"],
    "checkpoint": ["test_checkpoint.py::test_resume_same_layout_is_bitwise_identical"],
    "comm": ["test_policy.py::test_make_comm_solo_forms"],
    "cli": ["test_cli_newcomer.py::test_help_lists_every_subcommand"],
    "config": ["test_config.py::test_hf_all_auto_zero2_resolves",
               "test_config_keys.py::test_every_schema_field_is_classified"],
    "deepspeed": ["test_deepspeed_facade.py::test_lion_update_rule"],
    "engine": ["test_ds_engine_surface.py::test_every_deepspeed_engine_method_is_served_or_refused_by_name"],
    "estimate": ["test_estimate.py::test_zero_paper_figure1_numbers"],
    "files": ["test_safetensors_io.py::test_range_reads_equal_load_file"],
    "fsdp": ["test_shard_api.py::test_plain_loop_matches_single_process[3]"],
    "inference": ["test_inference_api.py::test_single_process_call_forms_generate_what_transformers_generates"],
    "launch": ["test_launch.py::test_default_rendezvous_restarts_with_a_fresh_store"],
    "layout": ["test_run_layout.py::test_served_combinations_pass_the_check",
               "test_run_layout.py::test_one_counter_for_every_group"],
    "moe": ["test_moe.py::test_dispatch_then_combine_restores_input_and_gradient[4-7-2]"],
    "monitor": ["test_monitor.py::test_sections_are_checked"],
    "nvme": ["test_nvme_folder.py::test_the_lock_refuses_a_second_run_and_close_removes_everything"],
    "optim": ["test_precision.py::test_state_dict_round_trip", "test_optim.py::test_warmup_decay_lr"],
    "pipeline": ["test_pipeline.py::test_schedules_and_partitions_in_process"],
    "sharded_init": ["test_safetensors_io.py::test_zero_init_source_refuses_other_shape"],
    "sequence_parallel": [
        "test_sequence_parallel.py::test_forward_backward_equal_whole_sequence[sdpa-2-15-None-False]"],
    "tensor_parallel": ["test_tensor_parallel.py::test_vocab_parallel_cross_entropy_matches_torch"],
    "train": ["test_train_job.py::test_text_file", "test_examples.py::test_train_without_a_config"],
    "utils": ["test_ds_conformance.py::test_repeating_loader_restarts"],
    "zero": ["test_zero.py::test_fp32_llama_matches_single_process[2]",
             "test_stage3.py::test_stage3_fp32_matches_single_process[llama]"],
    # the modules at the package's top level (errors, units), and the suite's own harness
    "shardwise": ["test_package_layout.py::test_no_import_cycles",
                  "test_rank_pool.py::test_each_case_starts_clean_whatever_the_last_one_left",
                  "test_fast_subset.py::test_every_package_has_a_fast_test"],
}


def fast_ids() -> list[str]:
    return [test_id for ids in FAST.values() for test_id in ids]


def fast_files() -> set[str]:
    return {test_id.split("::")[0] for test_id in fast_ids()}


def is_fast(nodeid: str, test_id: str) -> bool:
    """``nodeid`` (tests/file.py::name[case]) is the test ``test_id`` names, or one of its cases."""
    rel = nodeid.split("tests/", 1)[-1]
    return rel == test_id or (rel.startswith(test_id + "[") and "[" not in test_id)
