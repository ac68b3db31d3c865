"""Process groups and the few collectives shardwise needs, with byte accounting.

Every collective the library issues goes through :class:`Comm`, so that
``engine.comm_stats()`` can report what each rank moved, and so that a failed or
timed-out collective becomes one clear error instead of a hang.

Byte accounting follows the ZeRO paper's volume model (per rank, before the ring
factor (N-1)/N): an all-reduce of S bytes counts 2S (a reduce-scatter plus an
all-gather), an all-gather counts its output, a reduce-scatter its input, a
broadcast its tensor.

The physical algorithm is chosen per backend. gloo's all-gather and
reduce-scatter are slower than its all-reduce of the same full buffer, so on
gloo both are a ring of point-to-point exchanges of shard-sized chunks (N-1
steps). Measured here by ``benchmarks/machine/bench_collectives.py`` (2 ranks, 64 MiB
fp32, quiet machine): gloo all_reduce 58 ms, all_gather 97 ms, reduce_scatter
99 ms; ring all-gather 20 ms, ring reduce-scatter 54 ms. NCCL uses the native
collectives. The gloo reduce-scatter is now a direct exchange that adds the ranks' chunks in rank
order (``comm/gloo_exchange.py``: the same bytes as the ring; one order for every element, so the
ZeRO stages agree to the bit).
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm.devices import check_rank_gpu, choose_backend
from shardwise.comm.gloo_exchange import GlooExchanges
from shardwise.comm.log import logged
from shardwise.comm.objects import MoreCollectives
from shardwise.comm.process import let_worker_threads_settle, quiet_progress_bars
from shardwise.comm.work import Work, pending_works
from shardwise.errors import UserError
from shardwise.launch.net import address_in_use, free_port, port_taken

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class RanksDivergedError(RuntimeError):
    """A collective failed or timed out: ranks are out of step, or a peer died."""


def init_distributed(backend: str | None = None, timeout: float | datetime.timedelta | None = None) -> None:
    """Join the job torchrun started (or run as a plain single process, world 1).

    NCCL with CUDA, gloo otherwise; each rank is bound to its local GPU. ``timeout``
    (seconds) bounds every collective: ranks that fall out of step fail within it
    with :class:`RanksDivergedError` instead of waiting out the 30-minute default.
    """
    if dist.is_available() and dist.is_initialized():
        return
    backend = choose_backend(backend)  # and refuse a rank without a GPU of its own, below: docs/gpu_first_hour.md
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=float(timeout))
    if timeout is None:
        timeout = datetime.timedelta(seconds=float(os.environ.get("SHARDWISE_TIMEOUT", 600)))
    inherited = "RANK" in os.environ  # set by a launcher, or by a parent job whose environment this one copied
    if not inherited:  # a plain `python script.py`: a world of one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "nccl":
        check_rank_gpu(local_rank)
        torch.cuda.set_device(local_rank)
    try:
        dist.init_process_group(backend=backend, timeout=timeout, **_attempt_store(timeout))
    except dist.DistNetworkError as exc:  # the store this process hosts cannot listen: one line, not a traceback
        if not address_in_use(exc):
            raise
        port = os.environ.get("MASTER_PORT")
        how = ("set MASTER_PORT to a free port, or unset it in a single process (a free one is chosen)"
               if not inherited else
               f"RANK={os.environ['RANK']} and MASTER_PORT came from the environment: started from inside a running "
               "job (a torchrun'd script, a notebook that called init_process_group), this process inherited its "
               "rendezvous; unset RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for a job of its own, "
               "or start it with `shardwise launch` (its ranks get a free port)")
        raise UserError(f"MASTER_PORT={port}: " + port_taken(port, how)) from None
    if dist.get_rank() != 0:
        quiet_progress_bars()
    _GLOBAL_TIMEOUT[0] = timeout.total_seconds()
    _OWN_GROUP[0] = True
    _register_teardown()  # atexit runs before the interpreter destroys anything


def _attempt_store(timeout: datetime.timedelta) -> dict:
    """Under torchrun restarts: the rendezvous store with a prefix of this attempt's own.

    torchrun keeps one store for every restart attempt and the default group's keys (each rank's
    gloo address) do not change name, so a restarted rank may read the address the previous
    attempt's peer left there and fail with "Gloo connectFullMesh failed ... Connection refused".
    A prefix per ``TORCHELASTIC_RESTART_COUNT`` makes every attempt read only its own keys.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_hosts_it, timeout=timeout)
    return {"store": dist.PrefixStore(f"shardwise/attempt{attempt}", store), "rank": rank, "world_size": world}


_GLOBAL_TIMEOUT = [600.0]
_DIVERGED = [False]  # a collective failed: the group is unusable, waiting on it could hang
_OWN_GROUP = [False]  # init_distributed created the default group (so teardown destroys it)
_TEARDOWN_REGISTERED = [False]


def collective_timeout() -> datetime.timedelta:
    """The collective timeout of this job (``init_distributed``'s; 600 s when a script made the group),
    for the subgroups the library creates: ``new_group`` would give them torch's 30-minute default."""
    return datetime.timedelta(seconds=_GLOBAL_TIMEOUT[0])


def _teardown() -> None:
    """At exit, finish what the library started; never leave gloo work to the interpreter.

    Scripts written for DeepSpeed end without ``destroy_process_group``. A gloo worker thread
    frees each finished collective after waking the rank that waited for it; the work holds
    tensors whose Python objects need the GIL to be freed. If the script's last collective
    (a loss ``all_reduce`` before it prints and returns) finishes just before the interpreter
    finalizes, the worker asks for the GIL during finalization, Python ends the thread inside a
    C++ destructor, and the process aborts ("terminate called without an active exception",
    SIGABRT) after a correct run: seen in gdb as ``~AsyncAllreduceWork`` in
    ``ProcessGroupGloo::runLoop`` -> ``take_gil`` -> ``pthread_exit``. So on a clean exit: wait
    for pending collectives, destroy the group shardwise created, then let worker threads run
    until they are idle (:func:`let_worker_threads_settle`). After an unhandled exception (its
    traceback already printed) or a failed collective, waiting could block on a peer that will
    never answer, so the process ends at once with exit code 1, before any destructor runs.
    """

    failed = getattr(sys, "last_value", None) is not None or _DIVERGED[0]
    if not failed:
        try:
            for work in pending_works():
                work.wait()
        except RanksDivergedError:
            failed = True
    if not failed:
        if _OWN_GROUP[0] and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        let_worker_threads_settle()
        return
    if getattr(sys, "last_value", None) is not None:  # exiting on an error anyway: skip the destructors
        import logging

        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)


def _register_teardown() -> None:
    """Once per process, whoever created the group: every exit path passes :func:`_teardown`."""
    if not _TEARDOWN_REGISTERED[0]:
        _TEARDOWN_REGISTERED[0] = True
        atexit.register(_teardown)


def compute_device() -> torch.device:
    """The device this rank computes on: its local GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class CommStats:
    """Bytes and calls per collective kind, since start (shared by every Comm)."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1

    def as_dict(self) -> dict[str, int]:
        out = {k: 0 for k in ("all_gather", "reduce_scatter", "all_reduce", "broadcast")}
        out.update(self.bytes)
        return out


class Comm(GlooExchanges, MoreCollectives):
    """Collectives over one process group, counted into a shared :class:`CommStats` (all-to-all with
    split sizes and object collectives: ``comm/objects.py``; gloo's exchanges: ``comm/gloo_exchange.py``)."""

    def __init__(self, group: dist.ProcessGroup | None = None, stats: CommStats | None = None,
                 solo: bool = False, scope: str = ""):
        """``solo``: a group of this rank alone (every collective is a no-op, counted as nothing).

        ``scope`` is appended to the kind in the byte counts, so traffic of one group (the
        replicas of hybrid sharding, which cross nodes) can be told apart in ``comm_stats()``.
        """
        self.group = group
        self.scope = scope
        if dist.is_initialized() and not solo:
            _register_teardown()  # also when the script created the group itself
        self.stats = stats if stats is not None else CommStats()
        on = dist.is_initialized() and not solo
        self.size = dist.get_world_size(group) if on else 1
        self.rank = dist.get_rank(group) if on else 0
        self.backend = dist.get_backend(group) if on else "none"
        self._emulate = self.backend == "gloo"
        self._free_buffers: dict[tuple, list[torch.Tensor]] = {}

    def _work(self, handle, kind: str, finish=None, p2p: bool = False) -> Work:
        return Work(handle, self, kind, finish, p2p=p2p)

    # -- error handling -------------------------------------------------------------
    def _guard(self, kind: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except torch.OutOfMemoryError:  # this rank's own failure (its caller names the phase), not a peer's
            raise
        except (RuntimeError, dist.DistBackendError) as e:  # gloo: timeout, peer gone
            _DIVERGED[0] = True
            raise RanksDivergedError(
                f"{kind} failed on rank {dist.get_rank()} of {dist.get_world_size()}: the ranks have "
                f"diverged (one rank skipped or added a collective, or a peer process died) or the "
                f"collective exceeded the timeout of {_GLOBAL_TIMEOUT[0]:.0f}s "
                f"(SHARDWISE_TIMEOUT, init_distributed(timeout=...) or --timeout). "
                f"The process group is unusable now; restart the job. "
                f"Backend said: {e}"
            ) from e

    # -- collectives ----------------------------------------------------------------
    @logged("all_reduce")
    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False) -> Work | None:
        if self.size == 1:
            return Work(None, self, "all_reduce") if async_op else None
        self.stats.add("all_reduce" + self.scope, 2 * t.numel() * t.element_size())
        h = self._guard("all_reduce", dist.all_reduce, t, op=op, group=self.group, async_op=async_op)
        return Work(h, self, "all_reduce") if async_op else None

    @logged("all_gather")
    def all_gather(self, full: torch.Tensor, async_op: bool = False) -> Work | None:
        """Fill ``full`` (1-D, size multiple of world) from every rank's shard of it, in place."""
        if self.size == 1:
            return Work(None, self, "all_gather") if async_op else None
        self.stats.add("all_gather" + self.scope, full.numel() * full.element_size())
        if self._emulate:
            return self._ring(full, async_op=async_op)
        shard = full.numel() // self.size
        mine = full.narrow(0, self.rank * shard, shard)
        h = self._guard("all_gather", _all_gather_single, full, mine, group=self.group, async_op=async_op)
        return Work(h, self, "all_gather") if async_op else None

    @logged("reduce_scatter")
    def reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, async_op: bool = False,
                       accumulate: bool = False) -> Work | None:
        """Sum ``full`` (1-D) over ranks and write (or add, ``accumulate``) this rank's shard into ``out``.

        ``full`` is clobbered. ``out`` may alias ``full``'s own shard (not with ``accumulate``).
        """
        if self.size > 1:
            self.stats.add("reduce_scatter" + self.scope, full.numel() * full.element_size())
        shard = full.numel() // self.size
        mine = full.narrow(0, self.rank * shard, shard)

        def copy_out() -> None:
            if accumulate:
                out.add_(mine)
            elif out.data_ptr() != mine.data_ptr():
                out.copy_(mine)

        if self.size == 1:
            copy_out()
            return Work(None, self, "reduce_scatter") if async_op else None
        if self._emulate:  # the sum is written straight into ``out`` unless it is added onto it
            if accumulate:
                return self._rank_order_reduce(full, async_op=async_op, finish=copy_out)
            return self._rank_order_reduce(full, async_op=async_op, finish=None, out=out)
        aliased = out.data_ptr() == mine.data_ptr()
        target = torch.empty_like(out) if (aliased or accumulate) else out
        h = self._guard("reduce_scatter", _reduce_scatter_single, target, full, group=self.group,
                        async_op=async_op)

        def finish() -> None:
            if accumulate:
                out.add_(target)
            elif target is not out:
                out.copy_(target)

        if not async_op:
            finish()
            return None
        return Work(h, self, "reduce_scatter", finish)

    @logged("all_reduce")
    def all_reduce_in_rank_order(self, flat: torch.Tensor, async_op: bool = False) -> Work | None:
        """SUM all-reduce of a 1-D ``flat`` (numel a multiple of the size) whose every element is
        summed in rank order, as ``reduce_scatter`` sums it: on gloo that reduce-scatter, then the
        ring all-gather (stage 0's gradients then carry the bits of stages 1-3's). Counted as an
        all-reduce (2S). NCCL: its native all-reduce (its order is its own)."""
        if self.size == 1 or not self._emulate:
            return self.all_reduce(flat, async_op=async_op)
        self.stats.add("all_reduce" + self.scope, 2 * flat.numel() * flat.element_size())
        rs = self._rank_order_reduce(flat, async_op=True, finish=None)

        def gather() -> None:
            rs.wait()
            ring = self._ring(flat, async_op=True)
            if ring is not None:
                ring.wait()

        if not async_op:
            gather()
            return None
        return Work(None, self, "all_reduce", gather)

    @logged("all_to_all", tensor_arg=1)
    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, kind: str = "all_to_all",
                   async_op: bool = False) -> Work | None:
        """Chunk i (along dim 0) of ``inp`` goes to rank i; chunk j of ``out`` comes from rank j.

        Counted under ``kind`` as the bytes of ``inp`` (the quantized reduce-scatter of
        ``zero/quantized_comm.py`` is one all-to-all and reports as a reduce-scatter).
        """
        if self.size == 1:
            out.copy_(inp)
            return Work(None, self, kind) if async_op else None
        self.stats.add(kind + self.scope, inp.numel() * inp.element_size())
        h = self._guard(kind, dist.all_to_all_single, out, inp, group=self.group, async_op=async_op)
        return Work(h, self, kind) if async_op else None

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    @logged("broadcast")
    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """Broadcast from group-rank ``src``."""
        if self.size > 1:
            self.stats.add("broadcast" + self.scope, t.numel() * t.element_size())
            self._guard("broadcast", dist.broadcast, t, src=self._global(src), group=self.group)

    @logged("barrier", tensor_arg=None)
    def barrier(self) -> None:
        if self.size > 1:
            self._guard("barrier", dist.barrier, group=self.group)


def make_comm(group: Any = "world", stats: CommStats | None = None, *, size: int | None = None,
              scope: str = "") -> Comm:
    """The one way the library makes a :class:`Comm` for a group it was handed or built.

    ``group``: a process group, ``"world"`` (every rank) or ``"solo"`` (this rank alone: every
    collective a no-op, counted as nothing); ``size`` 1 is solo too (a group of one, as a Megatron
    ``mpu`` reports it, needs no process group). ``stats``: the counter this comm adds to (None: a
    fresh one, so e.g. checkpoint traffic stays out of the engine's ``comm_stats()``).
    """
    if size == 1 or (isinstance(group, str) and group == "solo"):
        return Comm(None, stats, solo=True)
    return Comm(None if isinstance(group, str) and group == "world" else group, stats, scope=scope)
