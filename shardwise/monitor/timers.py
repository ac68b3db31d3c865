"""Wall-clock timers and memory lines in DeepSpeed's names and formats (``wall_clock_breakdown``,
``memory_breakdown``).

The engine's phases, per micro-step and summed over the optimizer step (DeepSpeed's timer names):
``fwd`` (the model's forward), ``bwd`` (all of ``engine.backward``), ``bwd_inner`` (the autograd
backward: gradients computed, each bucket's reduction launched as its gradients are ready),
``bwd_allreduce`` (the end of backward: the reductions that never launched during it are done,
and stage 3 releases its gathered parameters), ``step`` (all of ``engine.step``: the wait for
the reductions, clipping, the optimizer, the parameter all-gather). Under CUDA every edge
synchronizes the device, so the times are the device's, as DeepSpeed's event timers are.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import torch

MICRO = ("fwd_microstep", "bwd_microstep", "bwd_inner_microstep", "bwd_allreduce_microstep", "step_microstep")
GLOBAL = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")
# the monitor tag of each global timer (Train/Samples/elapsed_time_ms_<suffix>)
TAGS = {"fwd": "forward", "bwd": "backward", "bwd_inner": "backward_inner", "bwd_allreduce": "backward_allreduce",
        "step": "step"}
GiB = 1024**3


def device_sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class PhaseTimers:
    """Milliseconds per phase: the micro-step's and the optimizer step's (summed over micro-steps)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = dict.fromkeys(MICRO + GLOBAL, 0.0)
        self._started: dict[str, float] = {}

    def start(self, phase: str) -> None:
        device_sync()
        self._started[phase] = time.perf_counter()

    def stop(self, phase: str) -> float:
        """Add the time since ``start(phase)`` to ``phase`` and ``phase_microstep``; returns it (ms)."""
        device_sync()
        ms = (time.perf_counter() - self._started.pop(phase)) * 1e3
        self.ms[phase] += ms
        self.ms[f"{phase}_microstep"] += ms
        return ms

    def line(self, names: tuple[str, ...]) -> str:
        """DeepSpeed's ``time (ms) | name: 1.23 | ...``."""
        return "time (ms)" + "".join(f" | {n}: {self.ms[n]:.2f}" for n in names)

    def reset(self, names: tuple[str, ...]) -> None:
        for n in names:
            self.ms[n] = 0.0


def _rss_bytes() -> tuple[int, int]:
    """This process's resident set size now and at its peak (Linux /proc; elsewhere the peak twice)."""
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        now = peak
    return now, max(now, peak)


def memory_now() -> dict[str, float]:
    """Device memory in GiB: CUDA's allocator (allocated, its peak, reserved, its peak), or on CPU the
    process's resident set (now, peak since start) for both pairs, since there is no allocator cache."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"MA": torch.cuda.memory_allocated() / GiB, "Max_MA": torch.cuda.max_memory_allocated() / GiB,
                "CA": torch.cuda.memory_reserved() / GiB, "Max_CA": torch.cuda.max_memory_reserved() / GiB}
    now, peak = _rss_bytes()
    return {"MA": now / GiB, "Max_MA": peak / GiB, "CA": now / GiB, "Max_CA": peak / GiB}


def memory_lines(message: str) -> list[str]:
    """DeepSpeed's ``see_memory_usage`` lines: the message, device memory, host memory. On CUDA the peaks
    are reset after each report (so each is the peak since the previous line), as DeepSpeed does."""
    m = memory_now()
    lines = [message, f"MA {m['MA']:.2f} GB         Max_MA {m['Max_MA']:.2f} GB         CA {m['CA']:.2f} GB"
                      f"         Max_CA {m['Max_CA']:.2f} GB "]
    try:
        import psutil

        vm = psutil.virtual_memory()
        lines.append(f"CPU Virtual Memory:  used = {(vm.total - vm.available) / GiB:.2f} GB, percent = {vm.percent}%")
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    return lines
