"""``shardwise.monitor``: what a run shows while it trains (docs/monitoring.md).

DeepSpeed's monitoring and profiling config sections, honoured:

- ``settings``: the sections as pydantic models (``tensorboard``, ``csv_monitor``, ``wandb``, ``comet``,
  ``comms_logger``, ``flops_profiler``); the config schema holds them.
- ``writers``: the monitors (TensorBoard, CSV, W&B, Comet), global rank 0 only, flushed every write;
  ``MissingExtra``, the one-line error for an enabled monitor whose package is missing.
- ``timers``: ``wall_clock_breakdown``'s phase timers and ``memory_breakdown``'s memory lines.
- ``flops`` / ``flops_report``: the FLOPs profiler (FlopCounterMode; full parameters at ZeRO-3; MFU).
- ``engine_monitor``: :class:`EngineMonitor`, the one object the engine's forward, backward and step call.

The communication logger (``comms_logger``, ``deepspeed.comm.log_summary()``) is ``shardwise.comm``'s
(``comm/log.py``): it times the collectives where they are issued.
"""

from __future__ import annotations

from shardwise.monitor.engine_monitor import EngineMonitor, count_tokens
from shardwise.monitor.flops import PEAK_TFLOPS, FlopsProfiler, peak_flops
from shardwise.monitor.settings import (
    CometConfig,
    CommsLoggerConfig,
    CSVConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from shardwise.monitor.timers import GLOBAL, MICRO, memory_lines, memory_now
from shardwise.monitor.writers import MissingExtra, Monitors

__all__ = ["EngineMonitor", "count_tokens", "PEAK_TFLOPS", "FlopsProfiler", "peak_flops", "CometConfig",
           "CommsLoggerConfig", "CSVConfig", "FlopsProfilerConfig", "TensorBoardConfig", "WandbConfig", "GLOBAL",
           "MICRO", "memory_lines", "memory_now", "MissingExtra", "Monitors"]
