"""Cut a model's trainable parameters into :class:`ShardedGroup` buckets.

Buckets follow the reverse of registration order, the order in which backward
produces gradients, so a bucket's reduction can start while backward goes on.
A bucket never mixes optimizer param groups (they may differ in weight decay or
learning rate) nor dtypes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.comm import Comm
from shardwise.zero.flat_group import InflightLimit, ShardedGroup
from shardwise.zero.policy import DEFAULT_GROUP_OPTIONS, GroupOptions, ShardPolicy
from shardwise.zero.store import ShardStore


def _pg_index(model: nn.Module, param_groups: list[dict]) -> dict[int, int]:
    """Parameter id -> optimizer param group index, validating the groups."""
    names = {id(p): n for n, p in model.named_parameters()}
    where: dict[int, int] = {}
    for gi, group in enumerate(param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"model_parameters group {gi} holds a tensor that is not a parameter of "
                                 "the model; pass model.parameters() or groups of them")
            if id(p) in where:
                raise ValueError(f"parameter {names[id(p)]!r} appears in two optimizer param groups")
            where[id(p)] = gi
    return where


def _never(p: nn.Parameter) -> bool:  # noqa: ARG001
    return False


@dataclass(frozen=True)
class OwnGroups:
    """A parameter sharded over a group of its own instead of the model's shard group.

    Expert parallelism's experts: each rank holds a slice (some whole experts) that the ranks of
    ``split`` do not hold, and the ranks of ``shard`` hold the same slice, so ZeRO shards and
    reduces it over ``shard`` only, and the gradient norm sums its squares over ``split`` too.
    """

    shard: Comm
    split: Comm


_OWN_GROUPS = "shardwise_own_groups"


def set_own_groups(p: nn.Parameter, groups: OwnGroups) -> None:
    setattr(p, _OWN_GROUPS, groups)


def own_groups(p: torch.Tensor) -> OwnGroups | None:
    """The parameter's own groups (None: the model's shard group, as every other parameter)."""
    return getattr(p, _OWN_GROUPS, None)


def _buckets(params: list[nn.Parameter], bucket_numel: int, kind: Callable) -> list[list[nn.Parameter]]:
    """Consecutive runs of one kind, each at most ``bucket_numel`` elements (or one param)."""
    out: list[list[nn.Parameter]] = []
    for p in params:
        cur = out[-1] if out else None
        if cur is None or kind(cur[0]) != kind(p) or sum(q.numel() for q in cur) + p.numel() > bucket_numel:
            out.append([p])
        else:
            cur.append(p)
    return out


@dataclass(frozen=True)
class Cutting:
    """How parameters are cut into groups. Stages 0-2 (``units`` None): size-bounded buckets of at
    most ``bucket_numel`` elements in backward order. Stage 3: one group per (unit, optimizer param
    group, kind), parameters of at most ``persistence_threshold`` elements kept whole in buckets."""

    bucket_numel: int
    units: list[list[nn.Parameter]] | None = None
    persistence_threshold: int = 0


@dataclass(frozen=True)
class BuildHooks:
    """What the caller plugs into the cut. ``materialize`` (zero.Init) gives a unit's meta
    parameters real values just before its groups are built, so only one unit is ever whole.
    ``tp_sharded`` tells a tensor-parallel slice from a replicated parameter (ZeRO reads no TP
    specs); a group holds one kind, so the global gradient norm can count replicated gradients
    once. ``store`` makes each group's shard store (zero/store.py; default: resident on the
    group's device). ``on_unit(i)`` is called once unit ``i``'s groups are built (progress)."""

    materialize: Callable[[list[nn.Parameter]], None] | None = None
    tp_sharded: Callable[[nn.Parameter], bool] = _never
    store: Callable[[], ShardStore] | None = None
    on_unit: Callable[[int], None] | None = None


def build_groups(model: nn.Module, param_groups: list[dict], comm: Comm, policy: ShardPolicy, cut: Cutting,
                 options: GroupOptions = DEFAULT_GROUP_OPTIONS, hooks: BuildHooks = BuildHooks(),
                 ) -> tuple[list[list[ShardedGroup]], list[list[ShardedGroup]]]:
    """Cut the model into groups (see :class:`Cutting`); returns (trainable groups per optimizer
    param group, groups per unit). Stage 3 puts frozen parameters in groups of their own (sharded,
    no optimizer state). Every group is built with ``options``."""
    order = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    make = _GroupMaker({id(p): n for n, p in model.named_parameters()}, comm, hooks, options)
    units, materialize = cut.units, hooks.materialize
    by_pg: list[list[ShardedGroup]] = [[] for _ in param_groups]
    if units is None:
        for gi in range(len(param_groups)):
            ps = [p for p in param_groups[gi]["params"] if p.requires_grad]
            ps.sort(key=lambda p: -order[id(p)])
            by_pg[gi] = [make(b, policy) for b in _buckets(ps, cut.bucket_numel, make.kind)]
        return by_pg, []
    pg_of = _pg_index(model, param_groups)
    persistent: list[list[nn.Parameter]] = [[] for _ in param_groups]
    by_unit: list[list[ShardedGroup]] = []
    for ui, unit_params in enumerate(units):
        if materialize is not None:
            materialize(unit_params)
        by_unit.append(_unit_groups(unit_params, len(param_groups), pg_of, policy, cut.persistence_threshold, make,
                                    by_pg, persistent))
        if hooks.on_unit is not None:
            hooks.on_unit(ui)
    keep_whole = ShardPolicy.for_stage(2)
    for gi, ps in enumerate(persistent):
        if materialize is not None:
            materialize(ps)
        ps.sort(key=lambda p: -order[id(p)])
        by_pg[gi] += [make(b, keep_whole) for b in _buckets(ps, cut.bucket_numel, make.kind)]
    return by_pg, by_unit


class _GroupMaker:
    """Builds the ShardedGroups of one model: names, comm, store and in-flight limit shared by all."""

    def __init__(self, names: dict[int, str], comm: Comm, hooks: BuildHooks, options: GroupOptions):
        self.names, self.comm, self.tp_sharded, self.store = names, comm, hooks.tp_sharded, hooks.store
        self.options, self.inflight = options, InflightLimit()

    def kind(self, p: nn.Parameter) -> tuple:
        """What must be equal inside one group: dtype, whether TP sliced it (for the grad norm), and
        the group it is sharded over (an expert's own, or the model's)."""
        own = own_groups(p)  # (described by sizes, not id(): the order of groups must agree across ranks)
        return p.dtype, self.tp_sharded(p), None if own is None else ("own", own.shard.size, own.split.size)

    def __call__(self, ps: list[nn.Parameter], pol: ShardPolicy, trainable: bool = True) -> ShardedGroup:
        own = own_groups(ps[0])
        comm = self.comm if own is None else own.shard
        g = ShardedGroup(ps, [self.names[id(p)] for p in ps], comm, pol, self.options, trainable=trainable,
                         store=self.store() if self.store is not None else None, inflight=self.inflight)
        g.tp_sharded = self.tp_sharded(ps[0])
        g.own_groups = own
        return g


def _unit_groups(unit_params: list[nn.Parameter], n_groups: int, pg_of: dict[int, int], policy: ShardPolicy,
                 persistence_threshold: int, make: _GroupMaker, by_pg: list[list[ShardedGroup]],
                 persistent: list[list[nn.Parameter]]) -> list[ShardedGroup]:
    """One stage-3 unit's groups: its frozen parameters (one group per kind), then per optimizer param
    group and kind its trainable ones; small ones are left in ``persistent`` (kept whole)."""
    groups: list[ShardedGroup] = []
    frozen = [p for p in unit_params if not p.requires_grad]
    frozen.sort(key=lambda p: str(make.kind(p)))  # one group per kind
    for b in _buckets(frozen, 1 << 62, make.kind):
        groups.append(make(b, policy, trainable=False))
    for gi in range(n_groups):
        ps = [p for p in unit_params if p.requires_grad and pg_of.get(id(p)) == gi]
        big = [p for p in ps if p.numel() > persistence_threshold]
        persistent[gi] += [p for p in ps if p.numel() <= persistence_threshold]
        big.sort(key=lambda p: str(make.kind(p)))
        for b in _buckets(big, 1 << 62, make.kind):
            g = make(b, policy)
            groups.append(g)
            by_pg[gi].append(g)
    return groups


@torch.no_grad()
def broadcast_model(model: nn.Module, groups: list[ShardedGroup], comm: Comm) -> None:
    """Start every rank from rank 0's weights (groups broadcast theirs when built), then the rest."""
    grouped = set()
    for g in groups:
        grouped.update(id(p) for p in g.params)
    for p in model.parameters():
        if id(p) not in grouped and own_groups(p) is None:  # (own groups: each holds its own slice)
            comm.broadcast(p.data, src=0)
    for b in model.buffers():
        comm.broadcast(b.data, src=0)
