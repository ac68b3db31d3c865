"""Split a HF MoE model's experts over the EP ranks (before ZeRO shards the rest).

:func:`apply_expert_parallel` keeps every parameter object (an optimizer built on
``model.parameters()`` still holds them) and only narrows the expert parameters of each MoE layer
(the two 3-D projections, and their biases where the family has them) to this rank's ``E / ep``
experts on dim 0, every rank slicing rank 0's tensors. It marks
them with their own groups (``zero.partition.OwnGroups``: sharded and reduced over the
expert-data-parallel group, squares summed over the EP group for the norm), so ZeRO at any stage
reduces each expert's gradient only among the ranks holding it and counts it once, and it switches
the model's ``config._experts_implementation`` to the dispatching forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm import Comm, CommStats, make_comm
from shardwise.comm.host import broadcast_through_device
from shardwise.errors import UserError
from shardwise.layout import ExpertMesh, get_expert_join_group, get_expert_mesh
from shardwise.moe.deferred import materialize_local_experts
from shardwise.moe.experts import IMPLEMENTATION, ExpertShard, expert_shard_of, register, set_expert_shard
from shardwise.moe.export import JOIN_TIMEOUT_S, install
from shardwise.moe.layouts import UnsupportedMoEError, expert_layout, expert_params
from shardwise.zero.partition import OwnGroups, own_groups, set_own_groups

log = logging.getLogger("shardwise")
_SLOT = "_shardwise_expert_parallel"


@dataclass
class ExpertParallel:
    """A model's expert parallelism: its groups and what each rank holds."""

    mesh: ExpertMesh
    model_type: str
    num_experts: int
    local_experts: int
    first_expert: int
    layers: int

    @property
    def ep_size(self) -> int:
        return self.mesh.ep.size

    def __deepcopy__(self, memo: dict) -> ExpertParallel:
        return self  # a deep-copied model holds the same experts and talks over the same groups


def restore_expert_groups(model: nn.Module) -> None:
    """Mark a split model's expert parameters again where the marks are missing.

    ``copy.deepcopy`` of a Parameter keeps none of its attributes, so a deep copy of a split model
    (TRL's reference model) holds local ``[E/ep, ...]`` experts that ZeRO would take for ordinary
    parameters: sharded over every rank with rank 0's values broadcast, a silently wrong model.
    The copy keeps each experts module's ``ExpertShard`` and the model's :class:`ExpertParallel`,
    which say what the parameters are. Called by the sharding construction (``fsdp.shard_module``).
    """
    ep = expert_parallel_of(model)
    if ep is None:
        return
    marked = [own_groups(p) for p in model.parameters() if own_groups(p) is not None]
    groups = marked[0] if marked else OwnGroups(shard=ep.mesh.edp, split=ep.mesh.ep)
    for m in model.modules():
        if expert_shard_of(m) is not None:
            for name in expert_params(m):
                if own_groups(getattr(m, name)) is None:
                    set_own_groups(getattr(m, name), groups)


def expert_parallel_of(model: nn.Module) -> ExpertParallel | None:
    """The model's :class:`ExpertParallel` (None without expert parallelism)."""
    return model.__dict__.get(_SLOT)


def is_expert_param(p: torch.Tensor) -> bool:
    """A parameter holding this rank's slice of some experts."""
    return own_groups(p) is not None


def _check_model(model: nn.Module, ep_size: int) -> None:
    if expert_parallel_of(model) is not None:
        raise UserError(f"{type(model).__name__} is split over experts already; apply expert parallelism once")
    if ep_size < 1:
        raise UserError(f"expert_parallel.autoep_size must be >= 1, got {ep_size}")


@torch.no_grad()
def apply_expert_parallel(model: nn.Module, ep_size: int, *, preset: str | None = None,
                          stats: CommStats | None = None, join_timeout_s: float = JOIN_TIMEOUT_S,
                          mesh: ExpertMesh | None = None) -> ExpertParallel:
    """Split every MoE layer's experts of ``model`` over ``ep_size`` consecutive ranks; in place.

    Collective (every rank, same arguments). ``preset``: DeepSpeed AutoEP's ``preset_model``,
    checked against ``model.config.model_type``. A model without a known MoE layout is refused
    (:class:`~shardwise.moe.layouts.UnsupportedMoEError`, one line naming its model type). A model
    built under ``zero.Init`` gets only this rank's experts materialized (``moe/deferred.py``).
    Afterwards ``model.state_dict()`` returns the full experts and is collective over the EP group
    (``moe/export.py``; a rank calling it alone fails after ``join_timeout_s``). ``mesh``: groups
    cut already (a run's layout, ``shardwise.layout.RunLayout``); None cuts them here, counted into ``stats``.
    """
    _check_model(model, ep_size)
    layout = expert_layout(model, preset)
    if layout.num_experts % ep_size:
        raise UnsupportedMoEError(f"expert_parallel.autoep_size {ep_size} must divide the {layout.num_experts} "
                                  f"experts of {layout.model_type!r}")
    if mesh is None:
        mesh = get_expert_mesh(ep_size, stats)
    elif mesh.ep.size != ep_size:
        raise UserError(f"expert_parallel.autoep_size {ep_size}: the layout's EP groups hold {mesh.ep.size} ranks")
    world = make_comm("world", mesh.ep.stats) if dist.is_initialized() else Comm(None, mesh.ep.stats, solo=True)
    local = layout.num_experts // ep_size
    first = mesh.ep.rank * local
    groups = OwnGroups(shard=mesh.edp, split=mesh.ep)
    join = get_expert_join_group(ep_size, join_timeout_s)
    for _, module in layout.modules:
        params = [getattr(module, name) for name in expert_params(module)]
        if not materialize_local_experts(params, first, local, world):  # zero.Init: this rank's only
            for p in params:
                broadcast_through_device(world, p.data, src=0)  # every rank slices the same experts
                p.data = p.data.narrow(0, first, local).clone()
        for p in params:
            set_own_groups(p, groups)
        set_expert_shard(module, ExpertShard(mesh.ep, layout.num_experts, first, local, join, join_timeout_s))
    install([m for _, m in layout.modules])
    register()
    model.config._experts_implementation = IMPLEMENTATION
    ep = ExpertParallel(mesh, layout.model_type, layout.num_experts, local, first, len(layout.modules))
    model.__dict__[_SLOT] = ep
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info(f"expert parallel {ep_size}-way ({layout.model_type}): {local} of {layout.num_experts} experts "
                 f"per rank in each of {len(layout.modules)} MoE layers")
    return ep
