"""The rank grid: every process group cut from one layout of the ranks, TP innermost.

Replicate x shard x tensor parallel: rank ``((replica * k) + shard) * t + tp`` for ``t`` TP ranks
and shard groups of ``k``: TP groups are consecutive ranks (as Megatron and torchtitan place them),
so TP traffic (every layer) and then the shard group's gathers stay inside a node, and only the
replicas' gradient all-reduce crosses nodes. With world 8, t = 2, k = 2: TP groups {0,1} {2,3} ...,
shard groups {0,2} {1,3} {4,6} {5,7}, replica groups {0,4} {1,5} {2,6} {3,7}. Without hybrid sharding k is the whole
data-parallel degree and the replica groups are single ranks (plain ZeRO).

Sequence parallelism cuts the data-parallel ranks of that grid once more: rank
``(dp * n + sp) * t + tp`` for SP degree ``n`` (TP innermost, then SP, then the data replicas, as
Megatron and DeepSpeed order them). An SP group is the ``n`` ranks with the same TP rank and replica
(``t`` apart); ZeRO's shard group above is unchanged (every rank with the same TP rank), so SP ranks
are data-parallel ranks to ZeRO. With world 8, t = 2, n = 2: TP {0,1} {2,3} ..., SP {0,2} {1,3}
{4,6} {5,7}, SP replicas {0,4} {1,5} {2,6} {3,7}.

Pipeline parallelism is outermost: with ``pp`` stages, stage ``s`` holds the ``world / pp``
consecutive ranks from ``s * world / pp``, and every group above is cut inside each stage's block
(rank ``((s * dp + d) * n + sp) * t + tp``: DeepSpeed's ``PipeModelDataParallelTopology`` numbering,
torchtitan's pp x dp x tp). The pipeline groups are the ``pp`` ranks ``world / pp`` apart: one rank
with the same data, SP and TP coordinates in every stage (:func:`get_pipe_group`).

This is the one place that builds process groups; :class:`~shardwise.layout.run.RunLayout` calls it
once per run with every degree, and the engine, ZeRO, SP and EP receive the groups from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shardwise.comm import Comm, CommStats, collective_timeout, make_comm

# (tp, k[, "pp", pp]) -> (shard group, tp group, replica group, full data-parallel group); SP's, EP's, hpZ's
# and the pipe groups under keys of their own; "default": the default group they were made in. Made once each
_GROUPS: dict[Any, Any] = {}


@dataclass
class Mesh:
    dp: Comm  # the shard group: ZeRO shards over it
    tp: Comm
    replicate: Comm  # ranks holding the same shard (hybrid sharding); solo without it
    dp_full: Comm  # every data-parallel rank (the shard group times its replicas)
    stats: CommStats
    secondary: Comm | None = None  # ZeRO++ hpZ: k consecutive data-parallel ranks (a node)


def _world() -> tuple[int, int]:
    """(world size, rank); the groups made for an earlier default group (destroyed and made again, as a
    fake world of the device guard is) are forgotten, so none is handed out after its group is gone."""
    if not dist.is_initialized():
        return 1, 0
    if _GROUPS.get("default") is not dist.group.WORLD:
        _GROUPS.clear()
        _GROUPS["default"] = dist.group.WORLD
    return dist.get_world_size(), dist.get_rank()


def _block(world: int, pp: int) -> int:
    """The ranks of one pipeline stage (the whole world without pipeline parallelism)."""
    if pp < 1 or world % pp:
        raise ValueError(f"pipeline stages {pp} must divide the world size {world} (pipeline.stages)")
    return world // pp


def _check(world: int, tp: int, shard: int, key: str = "zero_optimization.mics_shard_size") -> None:
    if tp < 1 or world % tp:
        raise ValueError(f"tensor parallel size {tp} must divide the world size {world} "
                         "(tensor_parallel.autotp_size)")
    dp = world // tp
    if shard < 1 or dp % shard:
        raise ValueError(f"shard group size {shard} must divide the data-parallel degree {dp} "
                         f"(world {world} / tensor parallel {tp}) ({key})")


def _groups_of(world: int, size: int, stride: int) -> list[list[int]]:
    """Every group of ``size`` ranks ``stride`` apart, each rank in exactly one."""
    out = []
    for start in range(world):
        first = start - (start // stride % size) * stride
        if first == start:
            out.append([start + i * stride for i in range(size)])
    return out


def _make(world: int, rank: int, size: int, stride: int):
    """Create every such group (collective: all ranks, same order) and return this rank's."""
    if size == 1:
        return "solo"
    if size == world:
        return "world"
    mine = None
    for ranks in _groups_of(world, size, stride):
        g = dist.new_group(ranks, timeout=collective_timeout())  # the job's timeout, not torch's 30 minutes
        if rank in ranks:
            mine = g
    return mine


def get_mesh(tp_size: int = 1, shard_size: int | None = None, secondary_size: int = 1,
             stats: CommStats | None = None, pp: int = 1) -> Mesh:
    """The groups for ``tp_size`` and a shard group of ``shard_size`` (None: all data-parallel ranks).

    ``secondary_size`` > 1 adds ZeRO++ hpZ's secondary groups: that many consecutive data-parallel ranks.

    ``pp`` > 1: the groups of each pipeline stage's ``world / pp`` ranks (module docstring).

    Every rank must call this with the same arguments; each call counts into ``stats`` (None: a fresh
    :class:`CommStats`; a run's layout passes its one counter). Bytes
    moved across replica groups are counted apart (``*_across_groups`` in ``comm_stats()``).
    """
    world, rank = _world()
    block = _block(world, pp)
    dp = block // tp_size if tp_size >= 1 else 0
    shard = dp if shard_size is None else shard_size
    _check(block, tp_size, shard)
    key = (tp_size, shard) if pp == 1 else (tp_size, shard, "pp", pp)
    if key not in _GROUPS:
        shard_g = _make(world, rank, shard, tp_size)
        _GROUPS[key] = (shard_g, _make(world, rank, tp_size, 1), _make(world, rank, dp // shard, tp_size * shard),
                        shard_g if shard == dp else _make(world, rank, dp, tp_size))
    shard_g, tp_g, rep_g, dp_g = _GROUPS[key]
    stats = stats if stats is not None else CommStats()
    mesh = Mesh(dp=make_comm(shard_g, stats), tp=make_comm(tp_g, stats),
                replicate=make_comm(rep_g, stats, scope="_across_groups"), dp_full=make_comm(dp_g, stats),
                stats=stats)
    if secondary_size > 1:
        _check(block, tp_size, secondary_size, "zero_optimization.zero_hpz_partition_size")
        skey = (tp_size, secondary_size, "secondary", pp)
        if skey not in _GROUPS:
            _GROUPS[skey] = (_make(world, rank, secondary_size, tp_size),)
        mesh.secondary = make_comm(_GROUPS[skey][0], stats, scope="_secondary")
    return mesh


def _inner_and_across(kind: str, size: int, what: str, key: str, stride: int = 1, pp: int = 1) -> tuple:
    """Groups of ``size`` ranks ``stride`` apart (consecutive for stride 1), and the groups of ranks
    ``size * stride`` apart (one rank of each inner group with the same offset) inside a pipeline
    stage's block: SP and its data replicas (stride: the TP degree), EP and its expert-data-parallel
    ranks. Made once."""
    world, rank = _world()
    block = _block(world, pp)
    if size < 1 or block % (size * stride):
        inner = f" x tensor parallel size {stride}" if stride > 1 else ""
        where = f"the stage's {block} ranks (world {world} / {pp} stages)" if pp > 1 else f"the world size {world}"
        raise ValueError(f"{what} {size}{inner} must divide {where} ({key})")
    if (kind, size, stride, pp) not in _GROUPS:
        _GROUPS[(kind, size, stride, pp)] = (_make(world, rank, size, stride),
                                             _make(world, rank, block // (size * stride), size * stride))
    return _GROUPS[(kind, size, stride, pp)]


@dataclass
class SequenceMesh:
    """Sequence parallelism's two groups (``get_sequence_mesh``)."""

    sp: Comm  # the ranks holding the shards of one sequence: same TP rank and replica, TP size apart
    data: Comm  # the ranks with the same TP and sequence-parallel rank: one per data-parallel replica
    tp_size: int = 1  # the TP degree the groups were cut for (each rank holds heads / tp_size heads)


def get_sequence_mesh(sp_size: int, stats: CommStats | None = None, tp_size: int = 1, pp: int = 1) -> SequenceMesh:
    """Cut the ranks into sequence-parallel groups of ``sp_size`` ranks, ``tp_size`` apart (module docstring).

    ZeRO keeps sharding and averaging over every data-parallel rank (``get_mesh``); SP ranks are
    data-parallel ranks to it that hold different tokens of the same samples, and the SP loss makes
    each of their gradients ``sp_size`` times its share (sequence_parallel/exchange.SumForward), so
    the average over all ranks is the samples' gradient. The SP group is
    innermost after TP, because its all-to-alls run in every layer (TP's all-reduces run twice as
    often). Every rank must call this with the same ``sp_size`` and ``tp_size``.
    """
    stats = stats if stats is not None else CommStats()
    sp_g, data_g = _inner_and_across("sp", sp_size, "sequence parallel size", "sequence_parallel_size",
                                     stride=tp_size, pp=pp)
    return SequenceMesh(sp=make_comm(sp_g, stats, scope="_sequence"), data=make_comm(data_g, stats),
                        tp_size=tp_size)


@dataclass
class ExpertMesh:
    """Expert parallelism's two groups, cut from the same rank grid as the others.

    ``ep``: ``ep_size`` consecutive ranks, each holding 1/ep_size of every MoE layer's experts
    (tokens move between them by all-to-all). ``edp``: the ranks ``ep_size`` apart, holding the
    same experts (expert gradients are reduced, and expert parameters ZeRO-sharded, over it only).
    """

    ep: Comm
    edp: Comm


def get_expert_mesh(ep_size: int, stats: CommStats | None = None, pp: int = 1) -> ExpertMesh:
    """The EP and expert-data-parallel groups for ``ep_size`` (collective: every rank, same argument);
    ``pp`` > 1: inside each pipeline stage's ranks."""
    stats = stats if stats is not None else CommStats()
    ep_g, edp_g = _inner_and_across("expert", ep_size, "expert parallel size", "expert_parallel.autoep_size",
                                    pp=pp)
    return ExpertMesh(ep=make_comm(ep_g, stats), edp=make_comm(edp_g, stats))


def get_pipe_group(pp: int) -> tuple[Any, list[int]]:
    """This rank's pipeline group and its ranks: the ``pp`` ranks ``world / pp`` apart, one per stage with
    the same coordinates inside it (collective: every rank, same argument; made once). Always a real
    group (a stage's point-to-point traffic runs on it), of one rank at ``pp`` 1."""
    world, rank = _world()
    block = _block(world, pp)
    key = ("pipe", pp)
    if key not in _GROUPS:
        mine: tuple[Any, list[int]] = (None, [])
        for ranks in _groups_of(world, pp, block):
            g = dist.new_group(ranks, timeout=collective_timeout())
            if rank in ranks:
                mine = (g, ranks)
        _GROUPS[key] = mine
    return _GROUPS[key]


def get_expert_join_group(ep_size: int, timeout_s: float) -> Any:
    """The EP groups again, on gloo with a ``timeout_s`` timeout (None for EP 1), made once per
    (size, timeout). Expert parallelism's state dict joins its EP peers on it before gathering the
    experts, so a call on one rank fails after ``timeout_s`` instead of hanging (moe/export.py).
    Collective: every rank, same arguments."""
    world, rank = _world()
    key = ("expert_join", ep_size, timeout_s)
    if key not in _GROUPS:
        mine = None
        if ep_size > 1:
            for ranks in _groups_of(world, ep_size, 1):
                g = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s))
                if rank in ranks:
                    mine = g
        _GROUPS[key] = (mine,)
    return _GROUPS[key][0]
