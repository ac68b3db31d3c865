"""State dicts and checkpoints of a model given to ``shardwise.shard``.

- :func:`full_state_dict`: ``model.state_dict()`` of the unsharded model (parameters gathered over
  the data-parallel and TP groups), on rank 0 only by default, on the CPU;
  :func:`load_full_state_dict` puts one (read on rank 0) back into every rank's shards.
- :func:`sharded_state_dict` / :func:`load_sharded_state_dict`: this rank's element range of every
  parameter (fp32 masters), to keep in memory or in the user's own files at the same layout.
- :func:`save_checkpoint` / :func:`load_checkpoint`: the engine's checkpoint files (any world size,
  stage or TP degree can load them, and an engine can load what the functional API wrote and
  vice versa), through :class:`TrainState`, the fields ``shardwise.checkpoint`` reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.checkpoint import load_checkpoint as load_engine_checkpoint
from shardwise.checkpoint import save_checkpoint as save_engine_checkpoint
from shardwise.comm import make_comm
from shardwise.fsdp.module import sharding_of
from shardwise.fsdp.optim import ShardedOptimizer
from shardwise.tensor_parallel.plan import gather_param
from shardwise.zero.stage3.gathered import GatheredParameters


def full_state_dict(model: nn.Module, rank0_only: bool = True, cpu: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded model's ``state_dict()`` (collective; ``{}`` on other ranks with ``rank0_only``)."""
    sh = sharding_of(model)
    sh.wait_for_params()
    mine = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    with GatheredParameters(list(model.parameters())):
        sd = model.state_dict()  # expert parallelism: the full experts (shardwise.moe's hook, collective)
        if sh.tp.size > 1:  # TP slices become the HF tensors (every TP rank takes part)
            for name, p in model.named_parameters(remove_duplicate=False):
                sd[name] = gather_param(p, sh.tp)
        out = {k: (v.detach().cpu() if cpu else v.detach()).clone() for k, v in sd.items()} if mine else {}
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load an unsharded state dict, read on data-parallel rank 0 (others may pass ``{}``), into
    every rank's shards and masters (collective). ``full_state_dict``'s output loads back."""
    sh = sharding_of(model)
    if sh.tp.size > 1:
        raise NotImplementedError("load_full_state_dict under tensor parallelism: use load_checkpoint, which "
                                  "reads a checkpoint at any TP degree")
    sh.wait_for_params()
    params = dict(model.named_parameters(remove_duplicate=False))
    targets = {**params, **{n: b for n, b in model.named_buffers() if n in state_dict or not strict}}
    box = [sorted(set(params) - set(state_dict))] if sh.dp_rank == 0 else [None]
    if dist.is_initialized():
        make_comm("world").broadcast_object_list(box, src=0)
    if strict and box[0]:
        raise KeyError(f"load_full_state_dict: {len(box[0])} parameters missing from the state dict, e.g. "
                       f"{box[0][0]!r} (pass strict=False to keep their current values)")
    with GatheredParameters(list(params.values()), modifier_rank=0):
        if sh.dp_rank == 0:
            for n, t in targets.items():
                if n in state_dict:
                    t.data.copy_(state_dict[n])
    grouped = {id(p) for g in sh.all_groups for p in g.params}
    for c in (sh.comm, sh.replica):  # what no group shares: frozen parameters (stages 0-2), buffers
        for t in {id(t): t for n, t in targets.items() if id(t) not in grouped}.values():
            c.broadcast(t.data, src=0)


def _pieces(model: nn.Module):
    """(name, group, the parameter's range [a, b) inside this rank's shard ``lo``) per owned piece."""
    for g in sharding_of(model).groups:
        for seg in g.owned:
            yield g.names[seg.index], g, seg.start, seg.stop, seg.offset


def sharded_state_dict(model: nn.Module) -> dict[str, dict[str, Any]]:
    """``{name: {"data", "start", "shape"}}``: elements ``[start, start + data.numel())`` of the
    flattened parameter (TP-local shape under TP) held by this rank, from its fp32 master."""
    sharding_of(model).wait_for_params()
    out = {}
    for name, g, a, b, lo in _pieces(model):
        p = g.params[g.names.index(name)]
        out[name] = {"data": g.master.detach().narrow(0, lo, b - a).clone(), "start": a, "shape": tuple(p.shape)}
    return out


@torch.no_grad()
def load_sharded_state_dict(model: nn.Module, state: dict[str, dict[str, Any]]) -> None:
    """Put back what :func:`sharded_state_dict` returned on this rank at the same layout (collective)."""
    sh = sharding_of(model)
    sh.wait_for_params()
    for name, g, a, b, lo in _pieces(model):
        entry = state.get(name)
        if entry is None or entry["start"] != a or entry["data"].numel() != b - a:
            raise ValueError(f"load_sharded_state_dict: {name!r} elements [{a}, {b}) of this rank are not in "
                             "the state (saved at another layout? use save_checkpoint/load_checkpoint)")
        g.master.narrow(0, lo, b - a).copy_(entry["data"])
    for g in sh.groups:
        g.drop_secondary()
        g.publish_master()
        g.wait_gathered()


class TrainState:
    """A sharded model, its optimizer and scheduler, seen as ``shardwise.checkpoint`` sees an engine."""

    def __init__(self, model: nn.Module, optimizer: ShardedOptimizer | None = None, lr_scheduler: Any = None):
        sh = sharding_of(model)
        self.sharding, self.sharded_optimizer = sh, optimizer
        self.module, self.groups = model, sh.groups
        self.comm, self.tp, self.replica, self.dp_world = sh.comm, sh.tp, sh.replica, sh.dp_world
        self.policy = sh.policy  # what is sharded; ``stage`` is derived from it
        self.optimizer = optimizer.optimizer if optimizer is not None else None
        self.lr_scheduler, self.loss_scaler = lr_scheduler, None
        self.gas = 1
        self.global_steps = self.micro_steps = optimizer.global_steps if optimizer is not None else 0
        self.skipped_steps = 0

    @property
    def stage(self) -> int:
        return self.policy.stage

    def wait_for_params(self) -> None:
        self.sharding.wait_for_params()


def save_checkpoint(save_dir: str | Path, model: nn.Module, optimizer: ShardedOptimizer | None = None,
                    lr_scheduler: Any = None, tag: str | None = None, client_state: dict | None = None,
                    exclude_frozen_parameters: bool = False) -> str:
    """The engine's sharded checkpoint of ``model`` (and optimizer, scheduler); collective. Returns its path.
    ``exclude_frozen_parameters``: as the engine's, frozen parameters are listed, not written."""
    return save_engine_checkpoint(TrainState(model, optimizer, lr_scheduler), save_dir, tag=tag,
                                  client_state=client_state, exclude_frozen_parameters=exclude_frozen_parameters)


def load_checkpoint(load_dir: str | Path, model: nn.Module, optimizer: ShardedOptimizer | None = None,
                    lr_scheduler: Any = None, tag: str | None = None,
                    strict: bool = True) -> tuple[str | None, dict | None]:
    """Load a checkpoint written by the engine or :func:`save_checkpoint`, at any layout; returns
    ``(path, client_state)``. Without ``optimizer`` only the weights are loaded."""
    state = TrainState(model, optimizer, lr_scheduler)
    for g in state.sharding.all_groups:
        g.drop_secondary()
    out = load_engine_checkpoint(state, load_dir, tag=tag, load_optimizer_states=optimizer is not None,
                                 load_lr_scheduler_states=lr_scheduler is not None,
                                 load_module_only=optimizer is None, load_module_strict=strict)
    if optimizer is not None:
        optimizer.param_groups, optimizer.state = optimizer.optimizer.param_groups, optimizer.optimizer.state
        optimizer.global_steps = state.global_steps
    return out
