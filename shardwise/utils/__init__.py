"""DeepSpeed's ``deepspeed.utils`` names scripts call: the ``safe_get_*`` / ``safe_set_*``
parameter accessors, and ``zero_to_fp32`` for offline fp32 weights."""

from __future__ import annotations

import logging

import torch.distributed as dist

from shardwise.utils import zero_to_fp32
from shardwise.utils.checkpoint_utils import clone_tensors_for_torch_save
from shardwise.utils.repeating_loader import RepeatingLoader
from shardwise.utils.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)
from shardwise.zero.stage3.leaf import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
)

logger = logging.getLogger("shardwise")


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the given ranks only (all ranks when ``ranks`` is None or holds -1)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


__all__ = [
    "logger", "log_dist", "zero_to_fp32", "RepeatingLoader", "safe_update_full_grad_vectorized",
    "clone_tensors_for_torch_save",
    "set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
    "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
    "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
]
