"""A collective on a tensor that lives on the host, whatever the backend: :func:`broadcast_through_device`.

NCCL takes device tensors only, yet some tensors are broadcast before the model is placed (a ``zero.Init``
parameter materialized for ``GatheredParameters`` before ``initialize``, the experts a rank slices from the
whole model). Here such a tensor goes through a copy on the collectives' device; under gloo, on the CPU,
it is broadcast as it is. It sits in ``comm/`` beside the collective it wraps, so the packages that
broadcast a host tensor (``sharded_init/``, ``moe/``) depend on ``comm/`` alone.
"""

from __future__ import annotations

import torch

from shardwise.comm.core import Comm, compute_device


def broadcast_through_device(comm: Comm, t: torch.Tensor, src: int = 0) -> None:
    """Broadcast ``t`` in place even where it lives on the host and the backend takes only device
    tensors (NCCL): a model not yet placed (expert slicing, ``GatheredParameters`` before
    ``initialize``) is broadcast through a copy on the collectives' device. Where ``t`` is there
    already (the CPU under gloo) it is broadcast as it is: nothing is copied."""
    buf = t.to(compute_device())
    comm.broadcast(buf, src=src)
    if buf is not t:
        t.copy_(buf)
