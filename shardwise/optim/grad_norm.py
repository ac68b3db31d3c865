"""The global gradient 2-norm over ZeRO shards and tensor-parallel slices (one definition).

ZeRO shards are disjoint pieces of the data-parallel gradient, so their squares are summed over
the shard group. Under TP a gradient is either a TP slice (squares summed over the TP group too) or
replicated (identical on every TP rank: counted once). Used by the engine's step,
``shardwise.clip_grad_norm_`` and ``tensor_parallel.tp_grad_norm``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from shardwise.comm import Comm, compute_device


def grad_square(grad: torch.Tensor) -> torch.Tensor:
    """One gradient's squared 2-norm as :func:`global_grad_norm` sums it (a float64 scalar)."""
    return torch.linalg.vector_norm(grad.detach().float()).double().square()


def global_grad_norm(grads: Iterable[tuple[torch.Tensor, bool]], tp: Comm | None = None,
                     shard: Comm | None = None, squared: bool = False) -> torch.Tensor:
    """2-norm (float64 scalar) of ``(grad, is_tp_slice)`` pairs.

    ``shard``: the group over which the grads are disjoint shards (None: every rank holds the
    whole gradient). ``tp``: the tensor-parallel group (None or size 1: no TP). inf/nan when any
    rank's gradient overflowed. ``squared``: each "grad" is already its :func:`grad_square` (NVMe offload
    streams the gradients through one host buffer and keeps only these), summed the same, bit for bit.

    The accumulator lives on the grads' device (an empty list: the collectives' device), so a
    step on a GPU sums on the GPU without a host round trip per gradient; the grads of one call
    share a device. Before a collective it moves to the collectives' device (offloaded CPU grads
    under NCCL); on the CPU both are the CPU and nothing moves.
    """
    pairs = list(grads)
    device = pairs[0][0].device if pairs else compute_device()
    sq = torch.zeros(2, dtype=torch.float64, device=device)  # [replicated, TP slice]
    for g, tp_slice in pairs:
        sq[int(tp_slice)] += g if squared else grad_square(g)
    if (shard is not None and shard.size > 1) or (tp is not None and tp.size > 1):
        sq = sq.to(compute_device())
    if shard is not None and shard.size > 1:
        shard.all_reduce(sq)
    if tp is not None and tp.size > 1:
        part = sq[1:].clone()
        tp.all_reduce(part)
        sq[1] = part[0]
    return sq.sum().sqrt()
