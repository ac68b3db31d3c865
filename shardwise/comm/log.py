"""The communication logger: DeepSpeed's ``comms_logger`` for shardwise's collectives.

Every collective of :class:`shardwise.comm.Comm` (the ZeRO traffic: gathers, reduce-scatters,
all-reduces, broadcasts) is timed when the logger is on, and recorded per operation and message
size: count, latencies, algorithmic and bus bandwidth, and the bytes ``engine.comm_stats()``
counts for it (the ZeRO paper's volume model: an all-reduce of S bytes moves 2S). The synchronous
collectives a script issues through ``deepspeed.comm`` / ``shardwise.comm`` (``all_reduce``,
``broadcast``, ...) are recorded too; asynchronous ones (``async_op=True``) are not, because their
latency is not known when the call returns.

Definitions (nccl-tests' PERFORMANCE.md, which DeepSpeed's table cites): the message size S is the
whole buffer (an all-gather's output, a reduce-scatter's input, an all-reduce's tensor); algbw =
S / latency; busbw = algbw x (n-1)/n for all-gather, reduce-scatter and all-to-all, x 2(n-1)/n for
all-reduce, x 1 for broadcast. DeepSpeed's own table differs in two quirks (its all-reduce algbw is
2S / latency, and its reduce-scatter size is multiplied by n twice); these are the standard ones.
The latency of an asynchronous library collective runs from its launch to the end of its
``wait()``, so a collective overlapped with compute includes the compute it hid behind.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# Comm's kinds under DeepSpeed's operation names (what its summary table and prof_ops use).
OP_NAMES = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
            "all_to_all": "all_to_all_single", "all_reduce": "all_reduce", "broadcast": "broadcast",
            "barrier": "barrier"}
_BUS_FACTOR = {"all_gather_into_tensor": lambda n: (n - 1) / n, "reduce_scatter_tensor": lambda n: (n - 1) / n,
               "all_to_all_single": lambda n: (n - 1) / n, "all_reduce": lambda n: 2 * (n - 1) / n,
               "broadcast": lambda n: 1.0, "barrier": lambda n: 1.0, "all_gather": lambda n: (n - 1) / n}
_COLUMNS = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)", "tput_avg (Gbps)",
            "busbw_avg (Gbps)", "Total Bytes")


def convert_size(size_bytes: float) -> str:
    """1536 -> '1.5 KB' (powers of 1024, as DeepSpeed prints sizes)."""
    if size_bytes <= 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB")
    i = min(int(math.floor(math.log(size_bytes, 1024))), len(names) - 1)
    return f"{round(size_bytes / 1024 ** i, 2)} {names[i]}"


def trim_mean(values: list[float], trim: float = 0.1) -> float:
    """The mean without the lowest and highest ``trim`` fraction (DeepSpeed averages this way)."""
    if not values:
        return 0.0
    data, k = sorted(values), int(round(len(values) * trim))
    kept = data[k:len(data) - k] or data
    return sum(kept) / len(kept)


@dataclass
class Record:
    """One operation at one message size."""

    count: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    algbw_gbps: list[float] = field(default_factory=list)
    busbw_gbps: list[float] = field(default_factory=list)
    volume_bytes: int = 0  # what comm_stats() counted for these calls


class CommsLogger:
    """What was recorded, and DeepSpeed's switches (``enabled``, ``prof_all``, ``prof_ops``, ...)."""

    def __init__(self) -> None:
        self.enabled = False
        self.prof_all = True
        self.prof_ops: list[str] = []
        self.verbose = False
        self.debug = False
        self.records: dict[str, dict[int, Record]] = {}
        self._lock = threading.Lock()

    def wants(self, op: str) -> bool:
        return self.enabled and (self.prof_all or op in self.prof_ops)

    def record(self, op: str, msg_bytes: int, volume: int, latency_ms: float, world: int, caller: str = "") -> None:
        """Add one call of ``op`` (a DeepSpeed operation name) on a group of ``world`` ranks."""
        seconds = max(latency_ms, 1e-6) / 1e3
        algbw = msg_bytes * 8 / seconds / 1e9
        busbw = algbw * _BUS_FACTOR.get(op, lambda n: 1.0)(world)
        name = f"{op} | [Caller Func: {caller}]" if self.debug and caller else op
        with self._lock:
            rec = self.records.setdefault(name, {}).setdefault(msg_bytes, Record())
            rec.count += 1
            rec.latencies_ms.append(latency_ms)
            rec.algbw_gbps.append(algbw)
            rec.busbw_gbps.append(busbw)
            rec.volume_bytes += volume
        if self.verbose and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"comm op: {name} | time (ms): {latency_ms:.2f} | msg size: {convert_size(msg_bytes)} | "
                  f"algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}", flush=True)

    def summary(self) -> dict[str, dict[int, dict[str, Any]]]:
        """Per operation and message size: count, latencies, bandwidths, bytes (DeepSpeed's dict keys)."""
        with self._lock:
            snapshot = {op: dict(sizes) for op, sizes in self.records.items()}
        out: dict[str, dict[int, dict[str, Any]]] = {}
        for op, sizes in snapshot.items():
            out[op] = {size: {"count": r.count, "total_latency_ms": sum(r.latencies_ms),
                              "avg_latency_ms": trim_mean(r.latencies_ms), "tput_avg_gbps": trim_mean(r.algbw_gbps),
                              "busbw_avg_gbps": trim_mean(r.busbw_gbps), "msg_size_bytes": size,
                              "msg_size_str": convert_size(size), "total_bytes": r.volume_bytes}
                       for size, r in sorted(sizes.items())}
        return out

    def table(self) -> str:
        """The summary as DeepSpeed's fixed-width table (plus the bytes each size moved)."""
        lines = ["".join(f"{c: <20}" for c in _COLUMNS)]
        for op, sizes in self.summary().items():
            lines.append(op)
            for s in sizes.values():
                lines.append(f"{' ': <20}{s['msg_size_str']: <20}{s['count']: <20}{s['total_latency_ms']: <20.2f}"
                             f"{s['avg_latency_ms']: <20.2f}{s['tput_avg_gbps']: <20.2f}{s['busbw_avg_gbps']: <20.2f}"
                             f"{convert_size(s['total_bytes']): <20}")
        return "\n".join(lines)

    def reset(self) -> None:
        with self._lock:
            self.records.clear()


COMMS_LOG = CommsLogger()
_ACTIVE = threading.local()  # a logged collective is running (its inner collectives are not logged again)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _caller(depth: int) -> str:
    """The function ``depth`` frames up (1: whoever called this; DeepSpeed's ``debug`` record names)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return ""


def logged(kind: str, tensor_arg: int = 0) -> Callable:
    """Decorator of a :class:`Comm` collective: when the logger wants ``kind``, time the call (to the
    end of its ``wait()`` when it returns pending work) and record it. ``tensor_arg``: the position
    of the buffer whose size is the message size (None: no tensor, a barrier)."""
    op = OP_NAMES[kind]

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(comm, *args: Any, **kwargs: Any) -> Any:
            if not COMMS_LOG.enabled or comm.size == 1 or getattr(_ACTIVE, "on", False) or not COMMS_LOG.wants(op):
                return fn(comm, *args, **kwargs)
            t = args[tensor_arg] if tensor_arg is not None and len(args) > tensor_arg else None
            size = t.numel() * t.element_size() if torch.is_tensor(t) else 0
            caller = _caller(2) if COMMS_LOG.debug else ""
            before = sum(comm.stats.bytes.values())
            t0 = time.perf_counter()
            _ACTIVE.on = True
            try:
                work = fn(comm, *args, **kwargs)
            finally:
                _ACTIVE.on = False
            volume = sum(comm.stats.bytes.values()) - before

            def done() -> None:
                _sync()
                COMMS_LOG.record(op, size, volume, (time.perf_counter() - t0) * 1e3, comm.size, caller)

            if work is None:
                done()
            else:
                work.on_done = done
            return work

        return call

    return wrap


def record_call(op: str, tensor: Any, world: int, fn: Callable[[], Any]) -> Any:
    """Run a script's synchronous ``deepspeed.comm`` collective ``fn`` and record it when wanted."""
    if not COMMS_LOG.wants(op) or world <= 1:
        return fn()
    size = sum(t.numel() * t.element_size() for t in tensor) if isinstance(tensor, list | tuple) else (
        tensor.numel() * tensor.element_size() if torch.is_tensor(tensor) else 0)
    t0 = time.perf_counter()
    out = fn()
    _sync()
    volume = 2 * size if op == "all_reduce" else size
    COMMS_LOG.record(op, size, volume, (time.perf_counter() - t0) * 1e3, world, _caller(3) if COMMS_LOG.debug else "")
    return out


def configure(deepspeed_config: Any = None, enabled: bool | None = None, prof_all: bool | None = None,
              prof_ops: list[str] | None = None, verbose: bool | None = None, debug: bool | None = None) -> None:
    """DeepSpeed's ``deepspeed.comm.configure``: from a config's ``comms_logger`` section and/or keywords."""
    section = getattr(deepspeed_config, "comms_logger", None)
    if section is not None and section.enabled:
        COMMS_LOG.enabled, COMMS_LOG.prof_all = True, section.prof_all
        COMMS_LOG.prof_ops, COMMS_LOG.verbose, COMMS_LOG.debug = list(section.prof_ops), section.verbose, section.debug
    for name, value in (("enabled", enabled), ("prof_all", prof_all), ("verbose", verbose), ("debug", debug)):
        if value is not None:
            setattr(COMMS_LOG, name, bool(value))
    if prof_ops is not None:
        COMMS_LOG.prof_ops = list(prof_ops)


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict | None:
    """Print the table on rank 0 (between two barriers, as DeepSpeed); ``return_dict``: also return it.

    ``show_straggler`` (DeepSpeed's min-over-ranks analysis) is refused rather than answered wrong."""
    if show_straggler:
        raise NotImplementedError("deepspeed.comm.log_summary(show_straggler=True) is not implemented by shardwise; "
                                  "call log_summary() (the per-rank table)")
    on = dist.is_initialized()
    if on:
        dist.barrier()
    rank = dist.get_rank() if on else 0
    if rank == 0:
        print(COMMS_LOG.table(), flush=True)
    if on:
        dist.barrier()
    if not return_dict:
        return None
    return {"summary": COMMS_LOG.summary(), "straggler_analysis": None,
            "metadata": {"world_size": dist.get_world_size() if on else 1, "rank": rank,
                         "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S")}}


def reset_log() -> None:
    COMMS_LOG.reset()


def start_profiling_comms() -> None:
    COMMS_LOG.prof_all = True


def stop_profiling_comms() -> None:
    COMMS_LOG.prof_all = False


def start_profiling_op(op_name_list: list[str]) -> None:
    COMMS_LOG.prof_ops = sorted(set(COMMS_LOG.prof_ops) | set(op_name_list))


def stop_profiling_op(op_name_list: list[str]) -> None:
    COMMS_LOG.prof_ops = [op for op in COMMS_LOG.prof_ops if op not in op_name_list]
