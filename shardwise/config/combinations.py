"""Which degrees combine: every refusal of a parallelism combination, in one function.

:func:`check_combinations` is the one place. It is decided from the config (and the world, and
whether the script brought its own groups) alone, so it stands on the config's floor: ``load_config``
runs it before its batch rule (which divides by the TP and SP degrees), and the run layout
(``RunLayout.from_config``) runs it again with the world it cuts, before any group is cut or any
parameter moves. Each refusal is one line naming the key.
"""

from __future__ import annotations

from typing import Any

from shardwise.config.schema import ConfigError
from shardwise.errors import UsageError, UserError


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


def _degrees_divide_world(cfg: Any, world: int) -> None:
    """TP x SP x DP = world (``layout/grid.py``): the batch rule counts ``world / (tp * sp)`` data ranks."""
    tp, sp = cfg.tp_size, cfg.sequence_parallel_size
    if tp < 1 or world % tp:
        raise ConfigError(f"tensor_parallel.autotp_size: {tp} does not divide the world size {world}; "
                          f"choose a divisor of {world}")
    if world % (sp * tp):
        with_tp = f" x tensor_parallel.autotp_size {tp}" if tp > 1 else ""
        raise ConfigError(f"sequence_parallel_size: {sp}{with_tp} does not divide the world size {world}; "
                          f"choose a divisor of {world // tp if world % tp == 0 else world}")


def _script_groups(cfg: Any, mpu: Any, sp_from_mpu: bool) -> None:
    """Groups the script cut itself: a Megatron ``mpu`` (its model is split already), or DeepSpeed's
    SP mpu (``register_with_transformers``, whose groups were cut without TP and which scripts hold)."""
    if mpu is not None and cfg.sequence_parallel_size > 1:
        raise UsageError("initialize(mpu=...) with sequence_parallel_size > 1 is not implemented by "
                         "shardwise; drop mpu= (shardwise cuts the SP groups itself)")
    if sp_from_mpu and cfg.tp_size > 1:
        raise UsageError("register_with_transformers' sequence parallelism with tensor_parallel.autotp_size > 1 "
                         "is not implemented by shardwise; set sequence_parallel_size in the config instead")
    if mpu is not None and cfg.tp_size > 1:
        raise UserError("mpu= and tensor_parallel.autotp_size > 1 both ask for tensor parallelism: the mpu's "
                        "model is already split; remove tensor_parallel.autotp_size")


def check_combinations(cfg: Any, world: int, mpu: Any = None, sp_from_mpu: bool = False) -> None:
    """Refuse, in one line, a combination of degrees the run cannot serve.

    ``world``: the ranks the config's degrees split (every rank; under an ``mpu``, ``load_config`` is
    given its data-parallel ranks). ``mpu``: a Megatron-style object whose groups the script cut, so the
    config may not ask for tensor, sequence or expert parallelism of shardwise's on top of it, and
    ZeRO shards over its data-parallel group (no shard or hpZ group of shardwise's own). ``sp_from_mpu``:
    the config's SP degree came from DeepSpeed's SP mpu. Errors: ``ConfigError`` for a degree that does
    not divide the world, ``UsageError`` for what ``initialize``'s arguments ask, ``UserError`` otherwise.
    """
    _degrees_divide_world(cfg, world)
    _script_groups(cfg, mpu, sp_from_mpu)
    zero = cfg.zero_optimization
    if mpu is None:
        if zero.mics_shard_size > 0:
            _divides_dp(world, cfg.tp_size, zero.mics_shard_size, "zero_optimization.mics_shard_size")
        if zero.zero_hpz_partition_size > 1:
            _divides_dp(world, cfg.tp_size, zero.zero_hpz_partition_size, "zero_optimization.zero_hpz_partition_size")
    if cfg.expert_parallel.enabled:
        _expert_combinations(cfg, world, mpu)
