"""The 2-D (data parallel x tensor parallel) layout of the ranks.

Tensor parallel groups are consecutive ranks (tp innermost, as Megatron and
torchtitan do): with world 4 and tp 2, TP groups are {0,1} {2,3} and data
parallel groups {0,2} {1,3}. TP traffic (every layer) then stays inside a node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from shardwise.comm import Comm, CommStats


@dataclass
class Mesh:
    dp: Comm
    tp: Comm
    stats: CommStats

    @property
    def dp_size(self) -> int:
        return self.dp.size

    @property
    def tp_size(self) -> int:
        return self.tp.size


_GROUPS: dict[int, tuple] = {}  # tp size -> (dp group, tp group): process groups are made once


def get_mesh(tp_size: int = 1) -> Mesh:
    """The dp and tp groups, with a fresh :class:`CommStats`; every rank must call this."""
    stats = CommStats()
    if tp_size in _GROUPS:
        dp_group, tp_group = _GROUPS[tp_size]
        return Mesh(dp=_comm(dp_group, stats), tp=_comm(tp_group, stats), stats=stats)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if tp_size < 1 or world % tp_size:
        raise ValueError(f"tensor parallel size {tp_size} must divide the world size {world} "
                         "(tensor_parallel.autotp_size)")
    if tp_size == 1:
        dp_group, tp_group = "world", "solo"
    elif tp_size == world:
        dp_group, tp_group = "solo", "world"
    else:
        tp_group = dp_group = None
        for d in range(world // tp_size):  # every rank creates every group, in the same order
            g = dist.new_group(list(range(d * tp_size, (d + 1) * tp_size)))
            if rank // tp_size == d:
                tp_group = g
        for t in range(tp_size):
            g = dist.new_group(list(range(t, world, tp_size)))
            if rank % tp_size == t:
                dp_group = g
    _GROUPS[tp_size] = (dp_group, tp_group)
    return get_mesh(tp_size)


def _comm(group, stats: CommStats) -> Comm:
    if group == "solo":
        return Comm(None, stats, solo=True)
    return Comm(None if group == "world" else group, stats)
