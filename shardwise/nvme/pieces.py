"""Sub-groups (DeepSpeed's ``sub_group_size``) and the gradients NVMe offload streams through its buffers.

**Sub-groups.** A group's master shard larger than ``sub_group_size`` elements is cut into pieces of at most
that many; each piece has its own swap file and is read, stepped and written alone, so the host buffers are
sized by the piece, not by the largest group (an embedding's shard). Stepping a piece is one step of the
optimizer on a tensor over the piece's master slice, with the piece's slices of the group's state and a
copy of the group's scalar state (Adam's ``step``): every piece starts from the same count and ends one
further, and the group's count becomes that. Exact (the bits of one whole step) for elementwise optimizers,
which are the only ones NVMe offload steps (``swapper.py``); a 16-bit master's piece steps through its own
fp32 window (``zero/low_precision.py``), also elementwise. Not split, stated in docs/offload.md: a 16-bit
master rounded stochastically (the rounding seeds are per group offset) and a stage-3 group whose
parameters have no resident shard to update a range of (``offload_param.device: nvme``).

**Gradients.** CPU offload gives every group's master an fp32 gradient on the host before the step (the
norm and clipping read all of them first): ``g x Ψ/N`` host bytes. NVMe offload leaves the reduced
gradient where the reduction put it (the accelerator's gradient shard, held there anyway until the step)
and moves it through host buffers twice: once a group at a time for the norm (scaled, squared, dropped)
and again a piece at a time into the buffer its piece steps in (scaled, clipped). The copies and the
arithmetic on them are CPU offload's (``flat_group.attach_master_grad``: cast to the master's dtype, times
the unscale; then the engine's clip, ``_foreach_mul_`` by the coefficient), so the norm and the step are
CPU offload's to the bit.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import optim

from shardwise.zero.host_copy import accelerated, fence
from shardwise.zero.low_precision import COMPENSATION, is_low_precision, kept_state_dtype, step_group

if TYPE_CHECKING:
    from shardwise.zero.flat_group import ShardedGroup


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + numel)`` of group ``index``'s master: one swap file, one buffer's worth."""

    index: int  # the group's position in the engine's groups (its swap file's name)
    group: ShardedGroup
    start: int
    numel: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.numel == self.group.own_numel

    @property
    def last(self) -> bool:
        return self.start + self.numel == self.group.own_numel

    @property
    def name(self) -> str:
        return f"group{self.index:05d}.swap" if self.whole else f"group{self.index:05d}.{self.start:012d}.swap"


def splittable(g: ShardedGroup) -> bool:
    """May ``g`` be stepped in pieces? (Not a 16-bit master rounded stochastically: its seeds are per group
    offset; at stage 3 a resident shard.)"""
    if is_low_precision(g) and g.precision.master_update == "stochastic":
        return False
    return not g.policy.shard_params or g.store.shard is not None


def plan(units: list[tuple[int, ShardedGroup]], sub_group_size: int) -> list[Piece]:
    """Every group's pieces, in order: whole where it fits in ``sub_group_size`` or may not be split."""
    pieces = []
    for index, g in units:
        size = max(1, sub_group_size if g.own_numel > sub_group_size and splittable(g) else g.own_numel)
        pieces += [Piece(index, g, a, min(size, g.own_numel - a)) for a in range(0, max(g.own_numel, 1), size)]
    return pieces


def copy_scaled(dst: torch.Tensor, src: torch.Tensor, unscale: float, coef: float) -> torch.Tensor:
    """``dst`` = ``src`` cast to ``dst``'s dtype, times ``unscale``, then times ``coef`` when it clips: the
    operations of CPU offload's ``attach_master_grad`` and the engine's clip, in that order."""
    dst.copy_(src, non_blocking=True)
    if accelerated(src.device):
        fence(src.device)  # the host reads it next (zero/host_copy.py, rule 1)
    dst.mul_(unscale)
    if coef < 1.0:  # as the engine clips: _foreach_mul_ rounds a 16-bit product otherwise than mul_ on the CPU
        torch._foreach_mul_([dst], coef)
    return dst


def step_piece(optimizer: optim.Optimizer, options: dict[str, Any], master: torch.Tensor, grad: torch.Tensor,
               state: dict[str, Any] | None) -> dict[str, Any]:
    """One optimizer step of ``master`` (a piece's slice, in its buffer) with ``grad`` and ``state`` (its
    slices of the group's per-element state and copies of the scalars; None before the first step: the
    optimizer makes it). Returns the piece's state after the step."""
    master.grad = grad
    if state is not None:
        optimizer.state[master] = state
    whole = optimizer.param_groups
    try:
        optimizer.param_groups = [{**options, "params": [master]}]
        optimizer.step()
    finally:
        optimizer.param_groups = whole
        new = optimizer.state.pop(master, {})
        master.grad = None
    return new


def step_low_piece(optimizer: optim.Optimizer, options: dict[str, Any], g: ShardedGroup, master: torch.Tensor,
                   grad: torch.Tensor, state: dict[str, Any] | None, index: int) -> dict[str, Any]:
    """:func:`step_piece` for a 16-bit master: ``low_precision.step_group`` on the piece (its fp32 window,
    its Kahan compensation in the piece's state), exact as the whole group's step for nearest and Kahan
    rounding (elementwise); returns the piece's state after the step."""
    master.grad = grad
    optimizer.state[master] = state if state is not None else {}
    try:
        step_group(optimizer, SimpleNamespace(master=master, precision=g.precision, comm=g.comm), options, index)
    finally:
        new = optimizer.state.pop(master, {})
        master.grad = None
    return new


def scalars_of(state: dict[str, Any], numel: int) -> dict[str, Any]:
    """The entries of a piece's (or group's) state that are not per element: copies (each piece steps its own)."""
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()
            if not (torch.is_tensor(v) and v.dim() == 1 and v.numel() == numel)}


def stand_in(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``numel`` elements that reads NaN and refuses writes (one element, stride 0)."""
    return torch.full((1,), float("nan"), dtype=dtype).expand(numel)


def is_stand_in(t: Any) -> bool:
    return torch.is_tensor(t) and t.dim() == 1 and t.numel() > 1 and t.stride() == (0,)


def state_keys(optimizer: optim.Optimizer, g: ShardedGroup) -> list[tuple[str, torch.dtype]]:
    """The per-element state ``optimizer`` keeps for ``g``'s master, and its dtypes, found by stepping a
    2-element probe with a fresh optimizer of the same class and the options of ``g``'s param group
    (``amsgrad`` in one group only adds a state there)."""
    probe = torch.zeros(2, dtype=torch.float32)
    probe.grad = torch.zeros(2)
    accepted = inspect.signature(type(optimizer).__init__).parameters
    options = next((pg for pg in optimizer.param_groups if any(p is g.master for p in pg["params"])),
                   optimizer.defaults)
    twin = type(optimizer)([probe], **{k: v for k, v in options.items() if k in accepted and k != "params"})
    twin.step()
    keys = sorted(k for k, v in twin.state[probe].items() if torch.is_tensor(v) and v.numel() == 2)
    if kept_state_dtype(g, COMPENSATION) is not None:
        keys.append(COMPENSATION)
    return [(k, kept_state_dtype(g, k)) for k in keys]
