"""Which backend a rank joins on, and whether it has a GPU of its own: decided before any CUDA call.

torch's own default (NCCL whenever CUDA is available, then ``set_device(LOCAL_RANK)``) fails on a
one-GPU machine with two ranks as CUDA's "invalid device ordinal" traceback in rank 1, or, were
both on ``cuda:0``, as NCCL's refusal of a duplicate GPU. Here the rank reads what torch sees
(``is_available`` / ``device_count``, which create no CUDA context) and refuses such a layout in
one line naming ``LOCAL_RANK``, the visible devices and the fixes. The launcher's choice
(``shardwise launch --backend``) reaches the ranks as ``SHARDWISE_BACKEND``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from shardwise.errors import UserError
from shardwise.launch.devices import BACKEND_ENV, rank_gpu_problem


def visible_gpus() -> int:
    """The GPUs torch sees in this process (0 without CUDA, or without NCCL to use them)."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return 0
    return torch.cuda.device_count()


def choose_backend(requested: str | None) -> str:
    """``requested``, else the launcher's ``SHARDWISE_BACKEND``, else NCCL where torch sees a GPU, else gloo."""
    if requested:
        return requested
    chosen = os.environ.get(BACKEND_ENV, "").strip().lower()
    if chosen not in ("", "auto", "nccl", "gloo"):
        raise UserError(f"{BACKEND_ENV}={chosen!r}: choose nccl, gloo or auto")
    if chosen in ("nccl", "gloo"):
        return chosen
    return "nccl" if visible_gpus() else "gloo"


def check_rank_gpu(local_rank: int) -> None:
    """An NCCL rank: refuse (one line) a ``local_rank`` without a GPU of its own, before ``set_device``."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
    problem = rank_gpu_problem(local_rank, local_world, visible_gpus())
    if problem is not None:
        raise UserError(problem)
