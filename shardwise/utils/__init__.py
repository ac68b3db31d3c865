"""DeepSpeed's ``deepspeed.utils`` names scripts call: the ``safe_get_*`` / ``safe_set_*``
parameter accessors, and ``zero_to_fp32`` for offline fp32 weights."""

from __future__ import annotations

from shardwise.utils import zero_to_fp32
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
)

__all__ = [
    "zero_to_fp32", "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
]
