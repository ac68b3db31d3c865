"""The engine's DeepSpeed-named accessors and thin delegates: what scripts written for DeepSpeed
call on the engine besides forward, backward and step.

They report configuration and counters the engine already has, or tear the engine down; the
training logic lives in :mod:`shardwise.engine`. Kept apart so
the engine file stays about forward, backward and step.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from shardwise.checkpoint import wait_for_checkpoint
from shardwise.comm import compute_device
from shardwise.engine.checks import UsageError, used_params_of  # noqa: F401 (UsageError re-exported)
from shardwise.engine.ds_surface import DEEPSPEED_ENGINE_METHODS, DeepSpeedEngineExtras, refuse
from shardwise.engine.offload_states import offload_states, reload_states
from shardwise.fsdp.state import full_state_dict


class EngineAccessors(DeepSpeedEngineExtras):
    """Mixin of :class:`~shardwise.engine.Engine`: DeepSpeed's ``engine.*()`` queries."""

    def __getattr__(self, name: str) -> Any:
        """As DeepSpeed's engine: an attribute the engine lacks is looked up on the wrapped model
        (``engine.config_class``, ``engine.gradient_checkpointing_enable()``, ``engine.lm_head``).
        A DeepSpeedEngine method that neither has raises ``DeepSpeedNameNotImplemented`` naming it."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None and name != "module" and hasattr(module, name):
                return getattr(module, name)
            if name in DEEPSPEED_ENGINE_METHODS:  # DeepSpeed has it, shardwise does not: say so by name
                raise refuse(name) from None
            raise

    # -- precision ------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return self.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.config.precision == "bf16"

    def bf16_master_weights_and_gradients(self) -> bool:
        """DeepSpeed's accessors of the low-precision master keys (docs/precision.md)."""
        return self.config.master_dtypes[0] == torch.bfloat16

    def bf16_optimizer_states(self) -> bool:
        return self.config.master_dtypes[1] == torch.bfloat16

    def fp16_master_weights_and_gradients(self) -> bool:
        return self.config.master_dtypes[0] == torch.float16

    def amp_enabled(self) -> bool:
        """NVIDIA apex AMP: never used by shardwise."""
        return False

    def loss_scale(self) -> float:
        """The configured static fp16 loss scale (0: dynamic), as DeepSpeed's ``loss_scale()``."""
        return float(self.config.fp16.loss_scale) if self.fp16_enabled() else 0.0

    def dynamic_loss_scale(self) -> bool:
        return self.fp16_enabled() and self.loss_scale() == 0

    @property
    def cur_scale(self) -> float:
        """The loss scale used by the next backward (1.0 without fp16)."""
        return float(self.loss_scaler.scale) if self.loss_scaler is not None else 1.0

    # -- ZeRO -----------------------------------------------------------------------
    @property
    def stage(self) -> int:
        """The ZeRO stage number, derived from ``policy`` (the sharding's, the one record of it)."""
        return self.policy.stage

    def zero_optimization(self) -> bool:
        """True when a ZeRO stage (>= 1) is on, as DeepSpeed's ``zero_optimization()``."""
        return self.policy.shard_optimizer

    def zero_optimization_stage(self) -> int:
        return self.policy.stage

    def zero_optimization_partition_gradients(self) -> bool:
        return self.policy.shard_grads

    def zero_optimization_partition_weights(self) -> bool:
        return self.policy.shard_params

    def zero_offload_optimizer(self) -> bool:
        return self.offload_optimizer

    def zero_offload_param(self) -> bool:
        return self.offload_param

    def zero_cpu_offload(self) -> bool:
        return self.offload_optimizer

    def zero_ignore_unused_parameters(self) -> bool:
        return bool(self.config.zero_optimization.ignore_unused_parameters)

    def gradient_clipping(self) -> float:
        return float(self.config.gradient_clipping or 0.0)

    # -- optimizer / schedule -------------------------------------------------------
    def optimizer_name(self) -> str | None:
        return self.config.optimizer.type if self.config.optimizer is not None else None

    def optimizer_params(self) -> dict | None:
        return dict(self.config.optimizer.params) if self.config.optimizer is not None else None

    def scheduler_name(self) -> str | None:
        return self.config.scheduler.type if self.config.scheduler is not None else None

    def scheduler_params(self) -> dict | None:
        return dict(self.config.scheduler.params) if self.config.scheduler is not None else None

    def get_lr(self) -> list[float]:
        """Each param group's current learning rate (empty without an optimizer)."""
        return [pg["lr"] for pg in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_mom(self) -> list[Any]:
        """Each param group's momentum: Adam's ``betas``, SGD's ``momentum``."""
        if self.optimizer is None:
            return []
        return [pg.get("betas", pg.get("momentum")) for pg in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last optimizer step, over every shard (before clipping)."""
        return self.last_grad_norm

    def was_step_applied(self) -> bool:
        """False when the last boundary's step was skipped (fp16 overflow)."""
        return getattr(self, "_step_applied", False)

    # -- batch and counters ---------------------------------------------------------
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.gas

    def steps_per_print(self) -> int:
        return self.config.steps_per_print

    @property
    def global_samples(self) -> int:
        """Samples consumed by the optimizer steps taken so far (global batch x steps)."""
        return self.global_steps * self.config.train_batch_size

    def wall_clock_breakdown(self) -> bool:
        return bool(self.config.wall_clock_breakdown)

    def memory_breakdown(self) -> bool:
        return bool(self.config.memory_breakdown)

    def flops_profiler_enabled(self) -> bool:
        return bool(self.config.flops_profiler.enabled)

    def get_wall_clock_timers(self) -> dict[str, float]:
        """The last ``step()``'s timers in ms, by DeepSpeed's names (``fwd``, ``bwd``, ``bwd_inner``,
        ``bwd_allreduce``, ``step`` and their ``_microstep`` forms; empty without ``wall_clock_breakdown``)."""
        return dict(self.monitor.wall_clock_cache)

    def sparse_gradients_enabled(self) -> bool:
        return False

    @property
    def sparse_tensor_module_names(self) -> set[str]:
        """Modules whose gradients are reduced as sparse tensors: none (``sparse_gradients`` is refused)."""
        return set()

    # -- ranks and devices ----------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return compute_device()

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def dp_world_size(self) -> int:
        return self.dp_world

    @property
    def mp_world_size(self) -> int:
        return self.tp.size

    def get_data_parallel_world_size(self) -> int:
        return self.dp_world

    def get_data_parallel_rank(self) -> int:
        return self.comm.rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp.size

    def get_model_parallel_rank(self) -> int:
        return self.tp.rank

    def get_tensor_parallel_rank(self) -> int:
        return self.tp.rank

    def get_data_parallel_group(self) -> Any:
        return self._process_group("get_data_parallel_group", self.comm)

    def get_model_parallel_group(self) -> Any:
        return self._process_group("get_model_parallel_group", self.tp)

    def _process_group(self, what: str, comm: Any) -> Any:
        """The torch process group behind ``comm`` (None is the world group, as in torch)."""
        mpu = getattr(self, "mpu", None)
        if mpu is not None:
            return getattr(mpu, what)()
        if comm.size == 1 and self.world_size > 1:  # a group of one: None would mean the whole world
            raise NotImplementedError(f"engine.{what}(): this group holds one rank and shardwise keeps no "
                                      "process group for it; its collectives are no-ops, skip them")
        return comm.group

    # -- teardown ---------------------------------------------------------------------
    def empty_partition_cache(self) -> None:
        """Stage 3: release every gathered parameter (DeepSpeed frees its partition cache)."""
        if self.fetcher is not None:
            self.fetcher.release_all()

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False) -> None:
        """DeepSpeed 0.16+: states off the accelerator until :meth:`reload_states` (``engine/offload_states.py``)."""
        offload_states(self, include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Put back what :meth:`offload_states` moved; the next step is as if it never had."""
        reload_states(self, non_blocking)

    def destroy(self) -> None:
        """Finish pending collectives and remove every hook the engine put on the model.

        Afterwards the module no longer gathers or reduces anything; at stage 3 its parameters
        stay released placeholders (gather them with ``GatheredParameters`` first if needed).
        """
        wait_for_checkpoint()  # as DeepSpeed's destroy commits a decoupled save
        self.sharding.remove()
        self.monitor.close()
        for swap in (getattr(self, "nvme", None), getattr(self, "nvme_params", None)):
            if swap is not None:  # NVMe offload: threads stopped, swap files removed
                swap.close()
        tracking = used_params_of(self)
        if tracking is not None:
            tracking.remove()

    # -- saving and compiling, as transformers' Trainer and accelerate call them ---------------
    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether a model save gathers the whole 16-bit weights (config key
        ``zero_optimization.stage3_gather_16bit_weights_on_model_save``); accelerate asks before
        calling :meth:`_zero3_consolidated_16bit_state_dict` at stage 3."""
        return bool(self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's state dict, every tensor at full shape in the compute dtype, on rank 0
        (``{}`` on the other ranks; collective). DeepSpeed's name: the Trainer and accelerate save
        stage-3 models through it; ``exclude_frozen_parameters`` keeps only trained parameters
        (PEFT adapters) and the buffers."""
        state = full_state_dict(self.module)
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    # -- aliases --------------------------------------------------------------------
    def save_fp16_model(self, save_dir: str, save_filename: str | None = None) -> None:
        """DeepSpeed's older name of ``save_16bit_model``."""
        self.save_16bit_model(save_dir, save_filename)
