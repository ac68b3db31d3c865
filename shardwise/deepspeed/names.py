"""Small DeepSpeed names the facade serves that shardwise has no other use for: constants of
DeepSpeed's config and launcher, ``tp_model_init``, and the hooks transformers patches.

They are DeepSpeed's public spellings (``deepspeed.runtime.config.ADAM_OPTIMIZER`` is the string
``"adam"`` a JSON config holds), so code written against DeepSpeed reads the same values here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
from packaging import version
from torch import nn

# deepspeed.runtime.lr_schedules: the scheduler names DeepSpeed's config accepts. Accelerate passes a
# scheduler whose class name is listed to initialize(lr_scheduler=); shardwise builds the three
# Warmup* ones from a config and refuses OneCycle / LRRangeTest there by name.
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
ONE_CYCLE = "OneCycle"
LR_RANGE_TEST = "LRRangeTest"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"

# deepspeed.runtime.config: optimizer names of the config's "optimizer.type".
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ADAGRAD_OPTIMIZER = "adagrad"
LION_OPTIMIZER = "lion"

# deepspeed.launcher.runner: the file of extra environment variables DeepSpeed's launcher exports
# (transformers' Trainer skips copying it); shardwise's launcher reads none.
DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"

# deepspeed.runtime.swap_tensor: the smallest tensor DeepSpeed's NVMe swapper moves (1 MiB).
MIN_SWAPPABLE_BYTES = 1024**2


class OffloadDeviceEnum(enum.StrEnum):
    """deepspeed.runtime.zero.offload_config: the values of ``offload_*.device``."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(enum.StrEnum):
    """deepspeed.runtime.zero.offload_config: what ``engine.offload_states(include=...)`` moves."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


def required_torch_version(min_version: float | None = None, max_version: float | None = None) -> bool:
    """deepspeed.utils.torch: whether torch's major.minor lies within the bounds."""
    have = version.parse(".".join(torch.__version__.split("+")[0].split(".")[:2]))
    if min_version is not None and have < version.parse(str(min_version)):
        return False
    return max_version is None or have <= version.parse(str(max_version))


# deepspeed.git_version_info: build facts; "0.0" means "not built against it" (no CUDA ops are built).
torch_info = {"version": ".".join(torch.__version__.split("+")[0].split(".")[:2]), "bf16_support": False,
              "cuda_version": "0.0", "nccl_version": "0.0", "hip_version": "0.0"}

# deepspeed.runtime.zero.partition_parameters: transformers swaps this wrapper around its model
# construction (to keep RoPE buffers' dtype). shardwise's Init wraps no tensor constructor, so the
# wrapper is never called and returns the constructor unchanged.
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: Any = None,
                                           target_device: Any = None) -> Callable:  # noqa: ARG001
    return fn


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None,
                  **kwargs: Any) -> nn.Module:  # noqa: ARG001
    """DeepSpeed's AutoTP entry point, as transformers calls it for ``tensor_parallel.autotp_size``.

    shardwise applies tensor parallelism inside ``initialize`` from the same config key (the
    model's own TP plan), so here the model is only cast and returned whole.
    """
    return model.to(dtype) if dtype is not None else model
