"""Which degrees combine: every refusal of a parallelism combination, in one function.

The config loader checks what it needs for the batch rule (the TP and SP degrees divide the world,
``config/load.py``); everything else about how the degrees fit together is refused here, once, before
any group is cut or any parameter is moved, each in one line naming the key.
"""

from __future__ import annotations

from typing import Any

from shardwise.errors import UserError


def _expert_combinations(cfg: Any, world: int, mpu: Any) -> None:
    """Expert parallelism beside the other degrees: what is not implemented yet is refused."""
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
    ep = cfg.expert_parallel.autoep_size
    if ep < 1 or world % ep:
        raise UserError(f"expert_parallel.autoep_size {ep} must divide the world size {world}; choose a divisor "
                        f"of {world}")


def _divides_dp(world: int, tp: int, size: int, key: str) -> None:
    dp = world // tp
    if size < 1 or dp % size:
        raise UserError(f"shard group size {size} must divide the data-parallel degree {dp} "
                        f"(world {world} / tensor parallel {tp}) ({key})")


def check_combinations(cfg: Any, world: int, mpu: Any = None) -> None:
    """Refuse, in one line, a combination of degrees the run cannot serve (``world``: every rank).

    ``mpu``: a Megatron-style object whose groups the script cut (its model is split already), so
    the config may not ask for tensor parallelism or experts split by shardwise on top of it.
    """
    zero = cfg.zero_optimization
    if mpu is not None and cfg.tp_size > 1:
        raise UserError("mpu= and tensor_parallel.autotp_size > 1 both ask for tensor parallelism: the mpu's "
                        "model is already split; remove tensor_parallel.autotp_size")
    if mpu is None:  # the mpu's data-parallel group is what ZeRO shards over: no grid of shardwise's own
        if zero.mics_shard_size > 0:
            _divides_dp(world, cfg.tp_size, zero.mics_shard_size, "zero_optimization.mics_shard_size")
        if zero.zero_hpz_partition_size > 1:
            _divides_dp(world, cfg.tp_size, zero.zero_hpz_partition_size, "zero_optimization.zero_hpz_partition_size")
    if cfg.expert_parallel.enabled:
        _expert_combinations(cfg, world, mpu)
