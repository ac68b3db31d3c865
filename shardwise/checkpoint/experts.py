"""Expert-parallel parameters in checkpoints: saved as the full tensors, by name.

Under expert parallelism a rank holds experts ``r*L .. r*L + L - 1`` of a MoE layer's 3-D
parameter (``shardwise.moe``): on dim 0, so its elements are one contiguous range of the full
tensor, starting at ``r * numel(local)``. A checkpoint therefore records every expert parameter
under its HF name with the full shape ``[E, ...]``, each rank's segments moved by its offset, and a
loader at any EP degree (or none) reads the range its own slice covers. Nothing else changes: ZeRO's
shards of the local slice are segments as for any parameter.
"""

from __future__ import annotations

import torch

from shardwise.zero.partition import own_groups


def saved_shape(p: torch.Tensor) -> list[int]:
    """The full (all EP ranks') shape of an expert parameter; the local shape otherwise."""
    shape = [int(s) for s in p.shape]
    own = own_groups(p)
    if own is not None:
        shape[0] *= own.split.size
    return shape


def saved_offset(p: torch.Tensor) -> int:
    """Where this rank's slice of an expert parameter starts in the flattened full tensor (0 otherwise)."""
    own = own_groups(p)
    return 0 if own is None else own.split.rank * p.numel()


def saved_numel(p: torch.Tensor) -> int:
    own = own_groups(p)
    return p.numel() * (1 if own is None else own.split.size)


def writes_group(g, shard_optimizer: bool, first_replica: bool, dp_rank: int) -> bool:
    """Does this rank write its owned part of group ``g``? Shards: every owner; whole (stage 0): the
    first rank of the group's own shard group (experts) or data-parallel rank 0."""
    if not first_replica:
        return False
    if shard_optimizer:
        return True
    return g.comm.rank == 0 if g.own_groups is not None else dp_rank == 0


def gather_experts(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's slice ``t`` of expert parameter ``p`` -> the full tensor (every EP rank; collective
    over the EP group). Other parameters: ``t`` itself."""
    own = own_groups(p)
    if own is None or own.split.size == 1:
        return t
    return gather_rows(t, own.split)


def gather_rows(t: torch.Tensor, comm) -> torch.Tensor:
    """Every rank's ``t`` stacked on dim 0 in rank order (all-gather over ``comm``, a ``Comm``; not
    counted as training traffic)."""
    if comm.size == 1:
        return t
    from shardwise.comm import Comm, CommStats

    ep = Comm(comm.group, CommStats())
    buf = t.new_empty((ep.size, t.numel()))
    buf[ep.rank].copy_(t.reshape(-1))
    ep.all_gather(buf.view(-1))
    return buf.view(ep.size * t.shape[0], *t.shape[1:])


def refuse_frozen_experts(module: torch.nn.Module) -> None:
    """Frozen expert parameters are not in the checkpoint's expert path yet: refuse rather than save
    one rank's experts for all."""
    for name, p in module.named_parameters():
        if not p.requires_grad and own_groups(p) is not None:
            raise NotImplementedError(f"checkpoint of a frozen expert parameter ({name}) under expert "
                                      "parallelism is not supported yet; train the experts or save with "
                                      "exclude_frozen_parameters=True")
