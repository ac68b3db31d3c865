"""``deepspeed.accelerator.get_accelerator()``: the device answers DeepSpeed's accelerator gives.

transformers and accelerate ask it for the current device name (to place buffers they broadcast
at stage 3) and DeepSpeed-style scripts for the backend, RNG and memory counters. shardwise
computes on the local GPU when CUDA is available and on the CPU otherwise (gloo), so there are two
answers: CUDA's, from ``torch.cuda``, and those of DeepSpeed's CPU accelerator.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from shardwise.deepspeed.missing import DeepSpeedNameNotImplemented


class Accelerator:
    """The subset of DeepSpeed's ``DeepSpeedAccelerator`` that libraries and scripts call."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self._name = "cuda" if self.cuda else "cpu"
        self._communication_backend_name = "nccl" if self.cuda else "gloo"

    # -- devices ------------------------------------------------------------------------
    def device_name(self, device_index: Any = None) -> str:
        return self._name if device_index is None or not self.cuda else f"cuda:{int(device_index)}"

    def current_device(self) -> int | str:
        return torch.cuda.current_device() if self.cuda else "cpu"  # a CPU index would mean a CUDA device

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self.cuda else "cpu"

    def device(self, device_index: Any = None) -> Any:
        return torch.cuda.device(device_index) if self.cuda else None

    def set_device(self, device_index: Any) -> None:
        if self.cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        """GPUs; on the CPU, DeepSpeed's answer: ``LOCAL_SIZE`` when set, else one device."""
        return torch.cuda.device_count() if self.cuda else int(os.environ.get("LOCAL_SIZE", 0)) or 1

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_synchronized_device(self) -> bool:
        return not self.cuda

    def resolves_data_dependency(self) -> bool:
        return not self.cuda

    def handles_memory_backpressure(self) -> bool:
        return not self.cuda

    def use_host_timers(self) -> bool:
        return not self.cuda

    def synchronize(self, device_index: Any = None) -> None:
        if self.cuda:
            torch.cuda.synchronize(device_index)

    # -- dtypes -------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self.cuda else True

    def is_fp16_supported(self) -> bool:
        return self.cuda

    def is_triton_supported(self) -> bool:
        return False

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float, torch.bfloat16] + ([torch.half] if self.cuda else [])

    # -- RNG ----------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> Any:
        return torch.cuda.manual_seed(seed) if self.cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.cuda.manual_seed_all(seed) if self.cuda else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self.cuda else torch.initial_seed()

    def get_rng_state(self, device_index: Any = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(device_index or "cuda") if self.cuda else torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device_index: Any = None) -> None:
        if self.cuda:
            torch.cuda.set_rng_state(state, device_index or "cuda")
        else:
            torch.set_rng_state(state)

    def random(self) -> Any:
        return torch.random

    # -- memory -------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: Any = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self.cuda else 0

    def max_memory_allocated(self, device_index: Any = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self.cuda else 0

    def memory_reserved(self, device_index: Any = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self.cuda else 0

    max_memory_reserved = memory_cached = memory_reserved

    def reset_peak_memory_stats(self, device_index: Any = None) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    reset_max_memory_allocated = reset_max_memory_cached = reset_peak_memory_stats

    def total_memory(self, device_index: Any = None) -> int:
        if self.cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: Any = None) -> int:
        if self.cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:  # noqa: ARG002
        return tensor.pin_memory() if self.cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self.cuda else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # -- streams and profiling ranges -----------------------------------------------------
    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self.cuda and stream is not None else contextlib.nullcontext()

    def current_stream(self, device_index: Any = None) -> Any:
        return torch.cuda.current_stream(device_index) if self.cuda else None

    def default_stream(self, device_index: Any = None) -> Any:
        return torch.cuda.default_stream(device_index) if self.cuda else None

    def range_push(self, msg: str) -> None:
        if self.cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self.cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Any) -> Any:
        return callback()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise DeepSpeedNameNotImplemented(f"deepspeed.accelerator.get_accelerator().{name}")


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator()
    return _ACCELERATOR


def is_current_accelerator_supported() -> bool:
    return True


def set_accelerator(accel: Any) -> None:
    """DeepSpeed lets a script choose the accelerator; shardwise's is fixed by the device."""
    global _ACCELERATOR
    _ACCELERATOR = accel
