"""Test-harness helpers DeepSpeed's tests use for gating and parametrizing, not library API:
a torch version check and the offload device vocabulary of the config (``"none"``, ``"cpu"``,
``"nvme"``, the strings shardwise's config takes)."""

from __future__ import annotations

import enum

import torch
from packaging import version


def required_torch_version(min_version: float | None = None, max_version: float | None = None) -> bool:
    have = version.parse(".".join(torch.__version__.split("+")[0].split(".")[:2]))
    if min_version is not None and have < version.parse(str(min_version)):
        return False
    return max_version is None or have <= version.parse(str(max_version))


class OffloadDeviceEnum(enum.StrEnum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


# DeepSpeed's build metadata, as an install without CUDA reports it ("0.0": not built against it).
torch_info = {"version": ".".join(torch.__version__.split("+")[0].split(".")[:2]), "bf16_support": False,
              "cuda_version": "0.0", "nccl_version": "0.0", "hip_version": "0.0"}

# Config vocabulary DeepSpeed's tests spell through constants (the strings a JSON config holds).
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
ONE_CYCLE = "OneCycle"
LR_RANGE_TEST = "LRRangeTest"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"

# A size DeepSpeed's tensor-fragment tests use as a hidden dimension (its swap threshold, 1 MiB).
MIN_SWAPPABLE_BYTES = 1024**2
