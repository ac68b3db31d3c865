"""Optimizers that are not elementwise step whole parameters, each owned by one rank.

A flat ZeRO shard is part of one parameter and part of the next, which is right only for an
optimizer that updates each element on its own (``zero/elementwise.py``). Any other one (Adafactor,
Muon, LAMB, a user's class) gets whole tensors instead, in the manner of
``torch.distributed.optim.ZeroRedundancyOptimizer``: the trainable parameters are dealt to the ranks
of the shard group, largest first to the least loaded, and each rank's optimizer holds fp32 copies
of only the tensors it owns (so optimizer state stays ~1/N per rank, as with flat shards).

One step, around the optimizer's own ``step()`` (registered as its step pre/post hooks, so both
front ends and a scheduler see a plain ``torch.optim.Optimizer``):

1. before: each group's reduced, averaged, clipped master gradients and fp32 master values are
   all-gathered from the flat shards (``ShardedGroup.master``, whatever the stage), and the owned
   tensors' pieces are copied out of them (``FlatLayout`` offsets); the group buffers are freed;
2. the optimizer steps the owned whole tensors with their full gradients;
3. after: each rank writes its owned tensors into a zeroed fp32 buffer of the group and the buffer
   is reduce-scattered into the masters. Every element has one owner and every other rank adds
   an exact 0.0, so each rank's master shard receives the updated values bit for bit; the usual
   publish (stages 1-2 all-gather, stage 3 the store) then shares them.

Stage 0 keeps whole masters on every rank: the optimizer steps views of them, with no traffic.
The cost (``memory()``, in ``memory_report()``): the owned fp32 copies (~4 bytes x Ψ/N), and during
``step()`` the owned gradients plus two fp32 buffers of the largest group; per step an all-gather of
the gradients, one of the values (skipped at stages 1-2 in fp32, where the published parameters are
the masters) and a reduce-scatter of the stepped values. TP slices are refused: their whole tensor spans ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shardwise.zero.elementwise import is_elementwise
from shardwise.zero.flat_group import ShardedGroup, owner_of

if TYPE_CHECKING:
    from shardwise.zero.builder import Sharding

ATTR = "shardwise_whole_tensor"  # set on an optimizer that steps whole tensors (see whole_tensor_of)


@dataclass
class OwnedTensor:
    """Parameter ``index`` of ``group``, whole, as this rank's optimizer steps it (fp32)."""

    group: ShardedGroup
    index: int
    tensor: torch.Tensor

    @property
    def offset(self) -> int:
        return self.group.offsets[self.index]

    @property
    def numel(self) -> int:
        return self.group.numels[self.index]


def deal_whole_tensors(sizes: list[int], world: int) -> list[int]:
    """The owning rank of each tensor: largest first, each to the least loaded rank (ties: the lowest).

    Deterministic, so every rank computes the same deal without communicating."""
    load, owner = [0] * world, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + sizes[i]
    return owner


def whole_tensor_of(optimizer: torch.optim.Optimizer | None) -> WholeTensorStepper | None:
    """The stepper of an optimizer built on whole tensors (None: flat shards, or no optimizer)."""
    return getattr(optimizer, ATTR, None)


class WholeTensorStepper:
    """This rank's whole tensors of a model's trainable groups, and the traffic around each step."""

    def __init__(self, sharding: Sharding, optimizer_name: str):
        self.groups = sharding.groups
        self.split = sharding.policy.shard_optimizer  # stage >= 1: a master is a shard of its group
        for g in self.groups:
            if g.tp_sharded:
                raise ValueError(f"{optimizer_name} is not an elementwise optimizer, so shardwise steps whole "
                                 f"parameters, but {g.names[0]!r} is a tensor-parallel slice (its whole tensor "
                                 "spans the TP ranks): use an elementwise optimizer (AdamW, SGD, ...) with "
                                 "tensor parallelism, or train without it")
        entries = [(g, i) for g in self.groups for i in range(len(g.params))]
        world, rank = (sharding.comm.size, sharding.comm.rank) if self.split else (1, 0)
        owners = deal_whole_tensors([g.numels[i] for g, i in entries], world)
        self.owned: dict[int, list[OwnedTensor]] = {id(g): [] for g in self.groups}
        self.by_param: dict[int, torch.Tensor] = {}
        for (g, i), r in zip(entries, owners, strict=True):
            if r == rank:
                t = self._whole(g, i)
                t.shardwise_name = g.names[i]  # read by name-based rules (DeepSpeed's Muon groups)
                self.owned[id(g)].append(OwnedTensor(g, i, t))
                self.by_param[id(g.params[i])] = t
        if self.split:  # an optimizer may read its parameters when it is built (an EMA, Lookahead)
            with torch.no_grad():
                for g in self.groups:
                    self._load_values(g)

    def _whole(self, g: ShardedGroup, i: int) -> torch.Tensor:
        """Stage 0: a view of the whole master; else an fp32 tensor of its own, filled before each step."""
        shape = g.params[i].shape
        if not self.split:
            return g.master.narrow(0, g.offsets[i], g.numels[i]).view(shape)
        return torch.zeros(shape, dtype=g.master.dtype, device=g.master.device)

    # -- optimizer groups ---------------------------------------------------------------
    def from_master_groups(self, master_groups: list[dict]) -> list[dict]:
        """Each group of flat masters as the owned whole tensors of its buckets (maybe none)."""
        group_of = {id(g.master): g for g in self.groups}
        return [{**pg, "params": [o.tensor for m in pg["params"] for o in self.owned[id(group_of[id(m)])]]}
                for pg in master_groups]

    def from_param_groups(self, param_groups: Iterable[dict], defaults: dict) -> list[dict]:
        """User groups of the model's parameters as this rank's whole tensors (a parameter owned by
        another rank is stepped there); a parameter in no group is not optimized, as in torch."""
        out = []
        for pg in param_groups:
            params = list(pg["params"])
            for p in params:
                if owner_of(p) is None:
                    raise ValueError("ShardedOptimizer(param_groups=...): a parameter of the groups is not one "
                                     f"of the sharded model's trainable parameters (shape {tuple(p.shape)})")
            whole = [self.by_param[id(p)] for p in params if id(p) in self.by_param]
            out.append({**defaults, **{k: v for k, v in pg.items() if k != "params"}, "params": whole})
        return out

    # -- the step ---------------------------------------------------------------------
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Run the gathers before and the scatter after every ``optimizer.step()``."""
        setattr(optimizer, ATTR, self)
        optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: self.load())
        optimizer.register_step_post_hook(lambda _opt, _args, _kwargs: self.store())

    def _gathered(self, g: ShardedGroup, shard: torch.Tensor | None) -> torch.Tensor:
        """The group's full fp32 flat buffer from every rank's ``shard`` (zeros where it is None)."""
        full = torch.empty(g.padded_numel, dtype=torch.float32, device=g.device)
        mine = full.narrow(0, g.own_start, g.own_numel)
        if shard is None:
            mine.zero_()
        else:
            mine.copy_(shard)
        g.comm.all_gather(full)
        return full

    @torch.no_grad()
    def load(self) -> None:
        """Give every owned tensor its current value and full gradient (all-gathered from the shards)."""
        for g in self.groups:
            owned = self.owned[id(g)]
            if not self.split:
                for o in owned:
                    grad = g.master.grad
                    o.tensor.grad = None if grad is None else grad.narrow(0, o.offset, o.numel).view(o.tensor.shape)
                continue
            self._load_values(g)
            grads = self._gathered(g, g.master.grad)
            for o in owned:
                o.tensor.grad = grads.narrow(0, o.offset, o.numel).view(o.tensor.shape).to(o.tensor.device,
                                                                                           copy=True)
            del grads

    def _load_values(self, g: ShardedGroup) -> None:
        """The owned tensors of ``g`` from the master shards (which edits and checkpoint loads update)."""
        if g.master_is_view and not g.policy.shard_params:
            g.wait_gathered()  # stages 1-2 in fp32: the published buffer already holds every master, exactly
            values = g.flat_param
        else:
            values = self._gathered(g, g.master)
        for o in self.owned[id(g)]:
            o.tensor.copy_(values.narrow(0, o.offset, o.numel).view(o.tensor.shape))

    @torch.no_grad()
    def store(self) -> None:
        """Put the stepped tensors back into every rank's master shards (one reduce-scatter per group)."""
        for g in self.groups:
            owned = self.owned[id(g)]
            for o in owned:
                o.tensor.grad = None
            if not self.split:
                continue  # the tensors are views of the master
            full = torch.zeros(g.padded_numel, dtype=torch.float32, device=g.device)
            for o in owned:
                full.narrow(0, o.offset, o.numel).copy_(o.tensor.reshape(-1))
            same = g.master.device == full.device and g.master.dtype == full.dtype
            out = g.master if same else torch.empty(g.own_numel, dtype=full.dtype, device=full.device)
            g.comm.reduce_scatter(full, out)
            if not same:
                g.master.copy_(out)

    # -- reports ----------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes of the whole-tensor mode: the owned fp32 copies (persistent; 0 at stage 0, views) and
        the most ``step()`` adds while it runs (owned gradients + two fp32 buffers of the largest group)."""
        owned = [o for os in self.owned.values() for o in os]
        copies = sum(o.numel * o.tensor.element_size() for o in owned) if self.split else 0
        peak = 0
        if self.split:
            largest = max((g.padded_numel for g in self.groups), default=0)
            peak = sum(o.numel * o.tensor.element_size() for o in owned) + 2 * 4 * largest
        return {"whole_tensor_params": copies, "whole_tensor_step_buffers": peak}


def optimizer_name(opt: Any) -> str:
    return opt.__name__ if isinstance(opt, type) else type(opt).__name__


def build_on_sharding(sharding: Sharding, master_groups: list[dict],
                      make: Callable[[list[dict]], torch.optim.Optimizer], kind: type | None) -> torch.optim.Optimizer:
    """``make(groups)`` over flat masters (an elementwise ``kind``) or over whole tensors (any other).

    ``kind`` None (a factory: the class is known only once it is built): it is built on whole
    tensors, which every optimizer accepts, and moved to the flat masters if it turns out
    elementwise (its state is still empty; DeepSpeed moves client optimizers the same way)."""
    if kind is not None and is_elementwise(kind):
        return make(master_groups)
    stepper = WholeTensorStepper(sharding, optimizer_name(kind) if kind is not None else "the optimizer")
    opt = make(stepper.from_master_groups(master_groups))
    if kind is None and is_elementwise(opt):
        if len(opt.param_groups) != len(master_groups):
            raise ValueError(f"the optimizer factory built {len(opt.param_groups)} param groups from "
                             f"{len(master_groups)}")
        for pg, mg in zip(opt.param_groups, master_groups, strict=True):
            pg["params"] = list(mg["params"])
        return opt
    stepper.attach(opt)
    return opt

