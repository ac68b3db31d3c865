"""torch's differentiable ``all_gather``, made right on gloo subgroups while the facade serves SP.

Why: ``torch.distributed.nn.functional.all_gather``'s backward on gloo goes through ``_AlltoAll``,
which scatters with ``src=`` the *group* rank where torch expects a *global* one, so it fails
("Global rank 0 is not part of group") for every group without rank 0: the SP groups of SP x DP.
Accelerate's documented SP loop and transformers' Trainer SP loss both call it on the SP group.
When ``register_with_transformers`` builds SP, :func:`serve_gloo_all_gather` points torch's name at
:func:`all_gather`, which on a gloo group is sequence parallelism's ``GatherShards`` (the same list;
backward, the reduce-scatter the original means); other backends keep torch's own. Nothing on disk changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm import Comm, make_comm
from shardwise.sequence_parallel import GatherShards


def all_gather(tensor: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, ...]:
    """``torch.distributed.nn.functional.all_gather`` with a backward that is right on gloo subgroups:
    on gloo, sequence parallelism's own differentiable gather (``GatherShards``: every rank's tensor
    in group order; backward, this rank's slot of the gradients summed over the ranks)."""
    group = dist.group.WORLD if group is None else group
    if dist.get_backend(group) == "gloo":
        return GatherShards.apply(tensor, _comm_of(group)).unbind(0)
    return _TORCH[0](tensor, group=group)


_COMMS: dict[Any, Comm] = {}  # process group -> its Comm (groups live as long as the process)


def _comm_of(group: Any) -> Comm:
    if group not in _COMMS:
        _COMMS[group] = make_comm("world" if group is dist.group.WORLD else group)
    return _COMMS[group]


_TORCH: list[Callable] = []  # torch's own all_gather, once replaced


def serve_gloo_all_gather() -> None:
    """Point ``torch.distributed.nn.functional.all_gather`` (and ``torch.distributed.nn.all_gather``)
    at :func:`all_gather`. Idempotent."""
    import torch.distributed.nn as dnn
    import torch.distributed.nn.functional as fn

    if fn.all_gather is all_gather:
        return
    _TORCH.append(fn.all_gather)
    fn.all_gather = all_gather
    if getattr(dnn, "all_gather", None) is _TORCH[0]:
        dnn.all_gather = all_gather
