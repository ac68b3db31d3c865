"""The rest of ``DeepSpeedEngine``'s public methods: served when simple, refused by name otherwise.

DeepSpeed 0.19's engine (``deepspeed/runtime/engine.py``) has 201 public methods. shardwise's
engine serves the training API and the accessors scripts and libraries call (``compat.py``,
``engine.py``); this mixin adds the batch-size setters and ``module_state_dict``, and
:data:`DEEPSPEED_ENGINE_METHODS` lists every name so that one the engine lacks raises
``DeepSpeedNameNotImplemented`` naming it (also an ``AttributeError``, so ``hasattr`` and
``getattr(engine, name, default)`` still answer "no") instead of a bare ``AttributeError``.
``tests/test_ds_engine_surface.py`` enumerates the list.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.engine.ds_missing import DeepSpeedEngineNameNotImplemented

# Every public method of DeepSpeed 0.19's DeepSpeedEngine (read from deepspeed/runtime/engine.py).
DEEPSPEED_ENGINE_METHODS: tuple[str, ...] = tuple("""
aio_config all_gather_scalar allreduce_and_copy allreduce_bucket allreduce_gradients allreduce_no_retain
amp_enabled amp_params autotp_size autotuning_enabled autotuning_end_profile_step autotuning_metric
autotuning_metric_path autotuning_model_info_path autotuning_profile_model_info autotuning_start_profile_step
backward bf16_master_weights_and_gradients bf16_optimizer_states bfloat16_enabled buffered_allreduce_fallback
checkpoint_serialization_enabled checkpoint_tag_validation_enabled checkpoint_tag_validation_fail
checkpoint_writer_enabled clip_fp32_gradients coalesce_grad_reduction communication_data_type compile
compile_autosp compile_autotp compile_zero_optimization_stage cpuadam_cores_perc curriculum_enabled_legacy
curriculum_learning_config curriculum_learning_enabled curriculum_params_legacy data_efficiency_config
data_efficiency_enabled data_sampling_config data_sampling_enabled dataloader_drop_last deepspeed_io destroy
dump_state dynamic_loss_scale dynamic_loss_scale_args eigenvalue_enabled eigenvalue_gas_boundary_resolution
eigenvalue_layer_name eigenvalue_layer_num eigenvalue_max_iter eigenvalue_stability eigenvalue_tol
eigenvalue_verbose elasticity_enabled empty_partition_cache eval flops_profiler_detailed flops_profiler_enabled
flops_profiler_module_depth flops_profiler_output_file flops_profiler_profile_step
flops_profiler_recompute_fwd_factor flops_profiler_top_modules forward fp16_auto_cast fp16_enabled
fp16_master_weights_and_gradients get_autosp_backend get_autotp_backend get_batch_info get_compile_time
get_data_parallel_rank get_data_types get_deepcompile_backend get_deepspeed_compile_backend
get_global_grad_norm get_lr get_model_parallel_rank get_mom get_pld_theta get_sequence_parallel_group
get_tensor_parallel_rank get_type get_wall_clock_timers gradient_accumulation_steps gradient_clipping
gradient_predivide_factor graph_harvesting initial_dynamic_scale is_compiled is_deepcompile_active
is_deepcompile_enabled is_elastic_model_parallel_supported is_first_weights_partition_group
is_gradient_accumulation_boundary is_iterable_style_dataset is_map_style_dataset is_sanity_checks_enabled
load_checkpoint load_module_state_dict load_moe_state_dict load_universal_checkpoint log_level loss_scale
managed_gradient_accumulation memory_breakdown mics_shard_size module_state_dict no_sync offload_states
optimizer_legacy_fusion optimizer_name optimizer_params pld_enabled pld_gamma pld_params pld_theta
postscale_gradients print_forward_breakdown quantize_training random_ltd_config random_ltd_enabled
random_ltd_initialize register_compile_pass reload_states save_16bit_model save_checkpoint save_fp16_model
scale scheduler_name scheduler_params set_custom_curriculum_learning_schedule set_data_post_process_func
set_gradient_accumulation_boundary set_train_batch_size set_train_micro_batch_size sparse_all_gather
sparse_allreduce sparse_allreduce_bucket sparse_allreduce_no_retain sparse_gradients_enabled step
steps_per_print super_offload swap_tensor_config tensor_parallel_config torch_autocast_dtype
torch_autocast_enabled torch_autocast_lower_precision_safe_modules train train_batch_size
train_micro_batch_size_per_gpu use_node_local_storage uses_parallelization_pass_only wall_clock_breakdown
was_step_applied zenflow_config zero_allgather_bucket_size zero_allgather_partitions zero_allgather_sequential
zero_allow_untested_optimizer zero_contiguous_gradients zero_cpu_offload zero_elastic_checkpoint
zero_force_ds_cpu_optimizer zero_grad zero_grad_hooks zero_gather_16bit_weights_on_model_save
zero_hpz_partition_size zero_ignore_unused_parameters zero_legacy_stage1 zero_load_from_fp32_weights
zero_log_trace_cache_warnings zero_max_live_parameters zero_max_reuse_distance zero_model_persistence_threshold
zero_module_granularity_threshold zero_multi_rank_bucket_allreduce zero_nvme_offload_optimizer
zero_offload_optimizer zero_offload_param zero_optimization zero_optimization_partition_gradients
zero_optimization_partition_weights zero_optimization_stage zero_overlap_comm zero_param_persistence_threshold
zero_partial_offload zero_prefetch_bucket_size zero_quantized_gradients zero_quantized_nontrainable_weights
zero_quantized_weights zero_reduce_bucket_size zero_reduce_scatter zero_round_robin_gradients
zero_save_muon_momentum_buffer_in_memory zero_sub_group_size zero_use_cpu_optimizer zeropp_loco_param
""".split())


def refuse(name: str) -> AttributeError:
    """The error for a DeepSpeedEngine method shardwise does not serve."""
    return DeepSpeedEngineNameNotImplemented(f"DeepSpeedEngine.{name}")


class DeepSpeedEngineExtras:
    """Mixin of the engine: the simple DeepSpeedEngine methods ``compat.py`` does not hold."""

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        return self.config.train_batch_size, self.config.train_micro_batch_size_per_gpu, self.gas

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """As DeepSpeed: a new global batch with the same micro-batch size, so the number of
        accumulated micro-batches changes; it must divide exactly."""
        per_step = self.config.train_micro_batch_size_per_gpu * self.dp_world
        if train_batch_size < 1 or train_batch_size % per_step:
            raise ValueError(f"set_train_batch_size({train_batch_size}): must be a positive multiple of "
                             f"train_micro_batch_size_per_gpu x data-parallel ranks = {per_step}")
        self._set_batch(train_batch_size // per_step, self.config.train_micro_batch_size_per_gpu)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """As DeepSpeed: a new micro-batch size with the same accumulation; the global batch follows.
        (The DataLoader ``initialize`` built keeps its batch size: build a new one.)"""
        if micro_batch_size < 1:
            raise ValueError(f"set_train_micro_batch_size({micro_batch_size}): must be positive")
        self._set_batch(self.gas, micro_batch_size)

    def _set_batch(self, gas: int, micro: int) -> None:
        if self.micro_steps % self.gas:
            raise RuntimeError("changing the batch size in the middle of an accumulation: call it right after "
                               "engine.step() at a gradient accumulation boundary")
        self.gas = gas
        self.micro_steps = self.global_steps * gas  # the next micro-step starts a new accumulation
        self.config.gradient_accumulation_steps = gas
        self.config.train_micro_batch_size_per_gpu = micro
        self.config.train_batch_size = gas * micro * self.dp_world

    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """The wrapped model's state dict (DeepSpeed's). At stage 3 call it inside
        ``GatheredParameters`` (otherwise it refuses, naming the fix), or use
        ``_zero3_consolidated_16bit_state_dict`` / ``save_16bit_model``."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    state.pop(prefix + name, None)
        return state

    # -- the ZeRO settings shardwise honours, as DeepSpeed's accessors read them ---------------
    def zero_reduce_bucket_size(self) -> int:
        return int(self.config.zero_optimization.reduce_bucket_size)

    def zero_allgather_bucket_size(self) -> int:
        return int(self.config.zero_optimization.allgather_bucket_size)

    def zero_prefetch_bucket_size(self) -> int:
        return int(self.config.zero_optimization.stage3_prefetch_bucket_size)

    def zero_param_persistence_threshold(self) -> int:
        return int(self.config.zero_optimization.stage3_param_persistence_threshold)

    def zero_max_live_parameters(self) -> int:
        return int(self.config.zero_optimization.stage3_max_live_parameters)

    def zero_overlap_comm(self) -> bool:
        return bool(self.config.zero_optimization.overlap_comm)

    def zero_quantized_weights(self) -> bool:
        return bool(self.config.zero_optimization.zero_quantized_weights)

    def zero_quantized_gradients(self) -> bool:
        return bool(self.config.zero_optimization.zero_quantized_gradients)

    def dataloader_drop_last(self) -> bool:
        return bool(self.config.dataloader_drop_last)
