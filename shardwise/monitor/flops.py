"""The FLOPs profiler (``flops_profiler``): one micro-step of global step ``profile_step``, counted.

Forward and backward are counted by ``torch.utils.flop_counter.FlopCounterMode`` (the operations
that run, so activation recomputation and attention are included as executed), on global rank 0,
for the first micro-batch of the step. Parameters are the model's full parameters: at ZeRO-3 the
profiler reads the whole shapes the placeholders keep (DeepSpeed's profiler reads the local shards
there and reports 0), under tensor parallelism the rank's slices (times ``mp_size`` for the model).
MACs are half the FLOPs (the counter counts matrix products, convolutions and attention: each
multiply-accumulate is two FLOPs). MFU divides the achieved forward+backward FLOPS by the
accelerator's peak: a small table of datasheet peaks (dense, no sparsity) for known GPUs, or
``shardwise.peak_tflops``; elsewhere (a CPU) the peak and the MFU are reported unknown. Latencies
are measured in the profiled micro-step, with the counter on, so the MFU is a lower bound.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from shardwise.monitor.timers import device_sync

# (substring of torch.cuda.get_device_name(), dense 16-bit tensor TFLOPS, fp32 TFLOPS); first match wins
PEAK_TFLOPS: tuple[tuple[str, float | None, float | None], ...] = (
    ("H200", 989.0, 67.0), ("H100 PCIe", 756.0, 51.0), ("H100", 989.0, 67.0), ("A100", 312.0, 19.5),
    ("L40S", 362.0, 91.6), ("L4", 121.0, 30.3), ("A10", 125.0, 31.2), ("V100", None, 15.7),
    ("MI300X", 1307.0, 163.4))
RULE = "-" * 78


def peak_flops(dtype: torch.dtype, given_tflops: float | None) -> tuple[float | None, str]:
    """The accelerator's peak FLOPS for ``dtype`` and where it comes from (None: unknown)."""
    if given_tflops:
        return given_tflops * 1e12, "shardwise.peak_tflops"
    if not torch.cuda.is_available():
        return None, "unknown on CPU: set shardwise.peak_tflops"
    name = torch.cuda.get_device_name()
    for key, half, single in PEAK_TFLOPS:
        if key in name:
            value = single if dtype == torch.float32 else half
            if value is not None:
                return value * 1e12, f"{name}, dense {str(dtype).removeprefix('torch.')} datasheet peak"
    return None, f"unknown for {name} ({dtype}): set shardwise.peak_tflops"


def number(x: float, unit: str = "") -> str:
    """1.5e9 -> '1.5 G' + unit (two decimals, DeepSpeed's notation)."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"), (1, ""), (1e-3, "m"), (1e-6, "u")):
        if abs(x) >= scale or (scale == 1 and x == 0):
            return f"{round(x / scale, 2):g} {prefix}{unit}"
    return f"{round(x / 1e-6, 2):g} u{unit}"


def params_str(n: float) -> str:
    return number(n).replace("G", "B").strip()


class FlopsProfiler:
    """Counts one forward and its backward; :meth:`report` writes DeepSpeed's profile shape."""

    def __init__(self, section: Any, peak_tflops: float | None) -> None:
        self.section, self.given_peak = section, peak_tflops
        self.done = False
        self.active = False
        self.fwd_latency = self.bwd_latency = 0.0
        self._fwd: FlopCounterMode | None = None
        self._bwd: FlopCounterMode | None = None
        self._hooks: list[Any] = []
        self._durations: dict[int, float] = {}
        self._starts: dict[int, list[float]] = {}

    def due(self, global_steps: int) -> bool:
        return not self.done and not self.active and self._fwd is None and global_steps == self.section.profile_step

    # -- counting ----------------------------------------------------------------------------
    def start_forward(self, model: nn.Module) -> None:
        self.model, self.active = model, True
        for m in model.modules():
            self._hooks.append(m.register_forward_pre_hook(self._pre))
            self._hooks.append(m.register_forward_hook(self._post))
        self._fwd = FlopCounterMode(display=False)
        device_sync()
        self._t0 = time.perf_counter()
        self._fwd.__enter__()

    def end_forward(self) -> None:
        self._fwd.__exit__(None, None, None)
        device_sync()
        self.fwd_latency = time.perf_counter() - self._t0
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def start_backward(self) -> None:
        self._bwd = FlopCounterMode(display=False)
        device_sync()
        self._t0 = time.perf_counter()
        self._bwd.__enter__()

    def end_backward(self) -> None:
        self._bwd.__exit__(None, None, None)
        device_sync()
        self.bwd_latency = time.perf_counter() - self._t0
        self.active = False

    def _pre(self, module: nn.Module, _args: Any) -> None:
        self._starts.setdefault(id(module), []).append(time.perf_counter())

    def _post(self, module: nn.Module, _args: Any, _out: Any) -> None:
        t0 = self._starts[id(module)].pop()
        self._durations[id(module)] = self._durations.get(id(module), 0.0) + time.perf_counter() - t0

    # -- results -----------------------------------------------------------------------------
    @property
    def fwd_flops(self) -> int:
        return self._fwd.get_total_flops() if self._fwd is not None else 0

    @property
    def bwd_flops(self) -> int | None:
        """None when the profiled backward did not go through ``engine.backward`` (not counted)."""
        return self._bwd.get_total_flops() if self._bwd is not None else None

    def module_flops(self) -> dict[str, int]:
        """Forward FLOPs of every module by its name in ``model`` ('' the model), children included."""
        counts = {k: sum(v.values()) for k, v in self._fwd.get_flop_counts().items()}
        root = type(self.model).__name__
        out: dict[str, int] = {}

        def walk(name: str, module: nn.Module) -> int:
            key = f"{root}.{name}" if name else root
            kids = sum(walk(f"{name}.{c}" if name else c, child) for c, child in module.named_children())
            out[name] = counts.get(key, kids)
            return out[name]

        walk("", self.model)
        return out

    def module_duration(self, module: nn.Module) -> float:
        own = self._durations.get(id(module), 0.0)
        return own if own else sum(self.module_duration(c) for c in module.children())

    def summary(self, dtype: torch.dtype) -> dict[str, Any]:
        """The numbers of the report, for scripts and tests."""
        params = sum(p.numel() for p in self.model.parameters())
        fwd, bwd = self.fwd_flops, self.bwd_flops
        latency = self.fwd_latency + self.bwd_latency
        peak, source = peak_flops(dtype, self.given_peak)
        achieved = (fwd + bwd) / latency if latency and bwd is not None else None
        if achieved is None:
            peak, source = None, "the backward was not counted (a plain loss.backward(), not engine.backward)"
        return {"params": params, "fwd_flops": fwd, "fwd_macs": fwd // 2, "bwd_flops": bwd,
                "fwd_latency_s": self.fwd_latency, "bwd_latency_s": self.bwd_latency,
                "fwd_bwd_flops_per_s": achieved, "peak_flops": peak, "peak_source": source,
                "mfu": achieved / peak if peak and achieved is not None else None}
