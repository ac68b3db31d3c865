"""The config's ``expert_parallel`` section (DeepSpeed AutoEP's keys) applied to a model.

Called by ``shardwise.initialize`` (so DeepSpeed scripts, the facade and the HF Trainer get it)
before the engine shards the model: the experts are split first, then ZeRO shards every other
parameter over all ranks and the experts over the expert-data-parallel group.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardwise.errors import UserError
from shardwise.moe.apply import ExpertParallel, apply_expert_parallel, expert_parallel_of


def _refuse_combinations(cfg: Any, mpu: Any) -> None:
    key = "expert_parallel.enabled"
    zero = cfg.zero_optimization
    if cfg.tp_size > 1:
        raise UserError(f"{key} with tensor_parallel.autotp_size > 1 is not supported yet; use one of them")
    if zero.mics_shard_size > 0:
        raise UserError(f"{key} with zero_optimization.mics_shard_size (hybrid sharding) is not supported yet")
    if zero.zero_hpz_partition_size > 1:
        raise UserError(f"{key} with zero_optimization.zero_hpz_partition_size (ZeRO++ hpZ) is not supported yet")
    if zero.zero_quantized_gradients or zero.zero_quantized_weights:
        raise UserError(f"{key} with ZeRO++ quantized collectives is not supported yet")
    if mpu is not None:
        raise UserError(f"{key} with a Megatron mpu is not supported; let shardwise build the groups")


def apply_from_config(model: nn.Module, cfg: Any, mpu: Any = None) -> ExpertParallel | None:
    """Split the experts when ``expert_parallel.enabled`` (collective); None when it is off."""
    section = cfg.expert_parallel
    if not section.enabled:
        return None
    _refuse_combinations(cfg, mpu)
    done = expert_parallel_of(model)
    if done is not None:  # initialize() again on a model an earlier engine split
        if done.ep_size != section.autoep_size:
            raise UserError(f"expert_parallel.autoep_size {section.autoep_size}: the model is split "
                             f"{done.ep_size}-way already")
        return done
    return apply_expert_parallel(model, section.autoep_size, preset=section.preset_model)
