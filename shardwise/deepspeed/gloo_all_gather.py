"""torch's differentiable ``all_gather``, made right on gloo subgroups while the facade serves SP.

Why: ``torch.distributed.nn.functional.all_gather``'s backward on gloo goes through ``_AlltoAll``,
which scatters with ``src=`` the *group* rank where torch expects a *global* one, so it fails
("Global rank 0 is not part of group") for every group without rank 0: the SP groups of SP x DP.
Accelerate's documented SP loop and transformers' Trainer SP loss both call it on the SP group.
When ``register_with_transformers`` builds SP, :func:`serve_gloo_all_gather` points torch's name at
:func:`all_gather`, which on a gloo group gathers the same list and whose backward sums every rank's
gradient for this rank's slot by one all-reduce over the group (the reduce-scatter the original
means: the same value); other backends keep torch's own. Nothing on disk changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class _GatherList(torch.autograd.Function):
    """Forward: every rank's ``tensor`` of the group, in group order. Backward: this rank's slot of the
    sum over ranks of the gradients of the gathered list."""

    @staticmethod
    def forward(ctx, group: Any, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
        ctx.group = group
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, tensor, group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # noqa: ANN001, ANN205
        stacked = torch.stack([g.contiguous() for g in grads])
        dist.all_reduce(stacked, group=ctx.group)
        return None, stacked[dist.get_rank(ctx.group)]


def all_gather(tensor: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, ...]:
    """``torch.distributed.nn.functional.all_gather`` with a backward that is right on gloo subgroups."""
    group = dist.group.WORLD if group is None else group
    if dist.get_backend(group) == "gloo":
        return _GatherList.apply(group, tensor)
    return _TORCH[0](tensor, group=group)


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
