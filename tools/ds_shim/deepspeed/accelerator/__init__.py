"""Test-harness shim: a CPU ``get_accelerator()`` with DeepSpeed's CPU accelerator's answers."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch


class CpuAccelerator:
    _name = "cpu"

    def device_name(self, device_index: Any = None) -> str:
        return "cpu"

    def current_device_name(self) -> str:
        return "cpu"

    def current_device(self) -> str:
        return "cpu"  # used as torch's device= argument; an int would mean a CUDA device

    def device(self, device_index: Any = None) -> None:
        return None

    def set_device(self, device_index: Any) -> None:
        return None

    def device_count(self) -> int:
        return 8  # processes share the CPU; never skip a 2-4 rank test for "too few devices"

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "gloo"

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return False

    def is_triton_supported(self) -> bool:
        return False

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float, torch.bfloat16]

    def is_synchronized_device(self) -> bool:
        return True

    def resolves_data_dependency(self) -> bool:
        return True

    def handles_memory_backpressure(self) -> bool:
        return True

    def use_host_timers(self) -> bool:
        return True

    def synchronize(self, device_index: Any = None) -> None:
        return None

    def manual_seed(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device_index: Any = None) -> None:
        torch.set_rng_state(state)

    def random(self) -> Any:
        return torch.random

    def empty_cache(self) -> None:
        return None

    def memory_allocated(self, device_index: Any = None) -> int:
        return 0

    max_memory_allocated = memory_reserved = max_memory_reserved = memory_cached = memory_allocated

    def reset_peak_memory_stats(self, device_index: Any = None) -> None:
        return None

    reset_max_memory_allocated = reset_max_memory_cached = reset_peak_memory_stats

    def total_memory(self, device_index: Any = None) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    available_memory = total_memory

    def stream(self, stream: Any) -> Any:
        return contextlib.nullcontext()

    def current_stream(self, device_index: Any = None) -> None:
        return None

    default_stream = current_stream

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        return None

    def range_pop(self, domain: Any = None) -> None:
        return None

    def pin_memory(self, tensor: torch.Tensor, **_: Any) -> torch.Tensor:
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def lazy_call(self, callback: Any) -> Any:
        return callback()

    def __getattr__(self, name: str) -> Any:
        from deepspeed._proxy import ShimMissing

        raise ShimMissing(f"SHIM-MISSING accelerator.{name}")


_ACCEL = CpuAccelerator()


def get_accelerator() -> CpuAccelerator:
    return _ACCEL


def is_current_accelerator_supported() -> bool:
    return True


def set_accelerator(accel: Any) -> None:
    return None
