"""Cut a model's trainable parameters into :class:`ShardedGroup` buckets.

Buckets follow the reverse of registration order, the order in which backward
produces gradients, so a bucket's reduction can start while backward goes on.
A bucket never mixes optimizer param groups (they may differ in weight decay or
learning rate) nor dtypes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from shardwise.comm import Comm
from shardwise.zero.flat_group import ShardedGroup, ShardPolicy


def normalize_param_groups(model: nn.Module, model_parameters: Iterable | None) -> list[dict]:
    """DeepSpeed's ``model_parameters``: None, an iterable of tensors, or of group dicts."""
    if model_parameters is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        groups = [dict(g) for g in items]
        for g in groups:
            g["params"] = list(g["params"])
        return groups
    if items and isinstance(items[0], tuple):  # named_parameters()
        items = [p for _, p in items]
    return [{"params": items}]


def build_groups(
    model: nn.Module,
    param_groups: list[dict],
    comm: Comm,
    policy: ShardPolicy,
    bucket_numel: int,
    **group_kwargs,
) -> list[list[ShardedGroup]]:
    """Returns, per optimizer param group, its buckets (in backward order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    seen: set[int] = set()
    out: list[list[ShardedGroup]] = []
    for gi, group in enumerate(param_groups):
        params = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"model_parameters group {gi} holds a tensor that is not a parameter of "
                                 "the model; pass model.parameters() or groups of them")
            if id(p) in seen:
                raise ValueError(f"parameter {names[id(p)]!r} appears in two optimizer param groups")
            seen.add(id(p))
            if p.requires_grad:
                params.append(p)
        params.sort(key=lambda p: -order[id(p)])
        buckets: list[list[nn.Parameter]] = []
        for p in params:
            cur = buckets[-1] if buckets else None
            if (cur is None or cur[0].dtype != p.dtype
                    or sum(q.numel() for q in cur) + p.numel() > bucket_numel):
                buckets.append([p])
            else:
                cur.append(p)
        out.append([ShardedGroup(b, [names[id(p)] for p in b], comm, policy, **group_kwargs)
                    for b in buckets])
    return out


@torch.no_grad()
def broadcast_model(model: nn.Module, groups: list[list[ShardedGroup]], comm: Comm) -> None:
    """Start every rank from rank 0's weights: one broadcast per bucket, then the rest."""
    grouped = set()
    for buckets in groups:
        for g in buckets:
            comm.broadcast(g.flat_param, src=0)
            if not g.master_is_view:
                g.master.copy_(g.flat_param.narrow(0, g.own_start, g.own_numel))
            grouped.update(id(p) for p in g.params)
    for p in model.parameters():
        if id(p) not in grouped:
            comm.broadcast(p.data, src=0)
    for b in model.buffers():
        comm.broadcast(b.data, src=0)
