"""DeepSpeed's ``mpu`` argument: a model the script already split across ranks (Megatron style).

The object answers ``get_model_parallel_{group,rank,world_size}()`` and
``get_data_parallel_{group,rank,world_size}()``. ZeRO shards over its data-parallel group; the
model-parallel group is the engine's TP group, used for the global gradient norm (TP-sharded
gradients are summed over it, replicated ones counted once) and for checkpoint names. Which
parameters are split is read from Megatron's marks: ``tensor_model_parallel`` (or the older
``model_parallel``) and ``partition_dim``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from shardwise.comm import Comm, CommStats, make_comm
from shardwise.layout import Mesh
from shardwise.tensor_parallel.layers import ShardSpec

_NEEDED = ("get_model_parallel_world_size", "get_model_parallel_rank", "get_model_parallel_group",
           "get_data_parallel_world_size", "get_data_parallel_rank", "get_data_parallel_group")


def _check(mpu: Any) -> None:
    missing = [m for m in _NEEDED if not callable(getattr(mpu, m, None))]
    if missing:
        raise TypeError(f"mpu= object {type(mpu).__name__} lacks {', '.join(missing)}: pass an object with "
                        "Megatron's get_{model,data}_parallel_{group,rank,world_size}() methods")


def mpu_sizes(mpu: Any) -> tuple[int, int]:
    """(model-parallel size, data-parallel size), checked against the world size."""
    _check(mpu)
    mp, dp = int(mpu.get_model_parallel_world_size()), int(mpu.get_data_parallel_world_size())
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mp * dp != world:
        raise ValueError(f"mpu: model-parallel size {mp} x data-parallel size {dp} != world size {world}; "
                         "shardwise supports tensor x data parallelism only (no pipeline stages)")
    return mp, dp


def mark_tp_params(model: nn.Module, tp: Comm) -> int:
    """Give every Megatron-marked parameter the engine's TP description; returns how many."""
    n = 0
    for name, p in model.named_parameters():
        if not (getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False)):
            continue
        dim = getattr(p, "partition_dim", None)
        if dim is None:
            raise ValueError(f"parameter {name!r} is marked model-parallel but has no partition_dim: set "
                             "p.partition_dim to the dimension it was split along (0: rows, 1: columns)")
        local = p.shape[dim]
        p._tp_spec = ShardSpec(dim=int(dim), full=local * tp.size, size=tp.size, rank=tp.rank)
        n += 1
    return n


def mesh_from_mpu(mpu: Any, model: nn.Module) -> Mesh:
    """The engine's dp and tp groups from ``mpu``; the model's split parameters marked for it (the run
    layout has refused ``tensor_parallel.autotp_size`` beside it: ``shardwise/config/combinations.py``)."""
    mp, dp = mpu_sizes(mpu)
    stats = CommStats()
    data = make_comm(mpu.get_data_parallel_group(), stats, size=dp)
    mesh = Mesh(dp=data, tp=make_comm(mpu.get_model_parallel_group(), stats, size=mp),
                replicate=make_comm("solo", stats), dp_full=data, stats=stats)
    if mp > 1 and mark_tp_params(model, mesh.tp) == 0:
        raise ValueError(f"mpu: model-parallel size {mp} but no parameter is marked tensor_model_parallel; "
                         "mark the split parameters (p.tensor_model_parallel = True, p.partition_dim = d)")
    return mesh
