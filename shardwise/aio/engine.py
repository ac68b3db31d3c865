"""The library's one I/O engine: tensors read from and written to files by threads that release the GIL.

``os.preadv`` / ``os.pwritev`` drop the GIL for the system call, so a read of gigabytes on a worker
thread leaves the main thread free to run the optimizer or launch kernels. A request (one tensor, one
file range) is cut into ``intra_op_parallelism`` contiguous parts, one per worker; each part is moved
by calls that carry ``queue_depth`` blocks of ``block_size`` bytes each (one block per call with
``single_submit``): DeepSpeed's ``aio`` keys, mapped onto the calls that exist here.

Errors are never swallowed: a failed or short transfer raises :class:`AioError` (file, offset, bytes)
from :meth:`IOHandle.wait`. :meth:`IOEngine.close` waits for what is in flight and stops the threads,
so nothing runs after the buffers it reads are gone; an engine used as a context manager closes.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from shardwise.aio.buffer import ALIGN, align_up
from shardwise.aio.files import AioError, AioFile, drop_cached


@dataclass(frozen=True)
class AioConfig:
    """DeepSpeed's ``aio`` section. ``intra_op_parallelism`` (DeepSpeed's name since 0.14; its older
    ``thread_count`` means the same here): the worker threads one request is split over.
    ``overlap_events``: submission and completion always overlap here (threads), so it is accepted and
    changes nothing."""

    block_size: int = 1 << 20
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True

    def __post_init__(self) -> None:
        for key in ("block_size", "queue_depth", "intra_op_parallelism"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"aio.{key}: a positive integer, got {value!r}")
        if self.block_size % ALIGN:
            raise ValueError(f"aio.block_size: a multiple of {ALIGN} bytes (direct I/O moves whole blocks), "
                             f"got {self.block_size}")

    @property
    def call_bytes(self) -> int:
        """The most bytes one system call moves."""
        return self.block_size * (1 if self.single_submit else self.queue_depth)


class IOHandle:
    """Transfers in flight; :meth:`wait` returns when all are done, raising the first error."""

    def __init__(self, futures: list[Future]):
        self._futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        errors = [f.exception() for f in self._futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first


def _byte_view(t: torch.Tensor) -> memoryview:
    """``t``'s bytes as a memoryview, made with ctypes: ``.numpy()`` would mark the storage not resizable
    for good (a stage-3 gather buffer read into must still be released by ``resize_(0)``). The view does
    not keep ``t`` alive: each transfer holds ``t`` until it is done (:meth:`IOEngine._move`)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("aio: tensors read or written are contiguous host tensors")
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


class IOEngine:
    """``engine.read(file, tensor, offset)`` / ``engine.write(...)`` return an :class:`IOHandle`."""

    def __init__(self, config: AioConfig | None = None):
        self.config = config or AioConfig()
        workers = max(2, self.config.intra_op_parallelism)  # a read and a write can be in flight together
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="shardwise-aio")
        self._lock = threading.Lock()
        self.bytes_read = self.bytes_written = 0
        # busy time: seconds during which at least one read (write, transfer of either kind) was in flight,
        # so parts running in parallel are not counted twice; bytes / busy seconds is the bandwidth achieved
        self.busy = {"read": 0.0, "write": 0.0, "any": 0.0}
        self._active = {"read": 0, "write": 0, "any": 0}
        self._since = {"read": 0.0, "write": 0.0, "any": 0.0}

    @property
    def seconds_read(self) -> float:
        return self.busy["read"]

    @property
    def seconds_written(self) -> float:
        return self.busy["write"]

    def _track(self, kind: str, start: bool) -> None:
        """Count a part in (``start``) or out of flight; called under ``_lock``."""
        now = time.perf_counter()
        for k in (kind, "any"):
            if start and self._active[k] == 0:
                self._since[k] = now
            self._active[k] += 1 if start else -1
            if not start and self._active[k] == 0:
                self.busy[k] += now - self._since[k]

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self, f: AioFile, t: torch.Tensor, offset: int = 0, need: int | None = None) -> IOHandle:
        """Fill ``t`` from ``f`` at ``offset`` (asynchronously). The file ending before ``need`` bytes
        (default: all of ``t``) is an error; bytes of ``t`` past the end of the file are left as they were."""
        return self._submit(f, t, offset, write=False, need=need)

    def write(self, f: AioFile, t: torch.Tensor, offset: int = 0) -> IOHandle:
        """Write ``t`` into ``f`` at ``offset`` (asynchronously)."""
        return self._submit(f, t, offset, write=True)

    def close(self) -> None:
        """Wait for every transfer in flight, then stop the threads (idempotent)."""
        self._pool.shutdown(wait=True)

    def read_now(self, f: AioFile, t: torch.Tensor, offset: int = 0, need: int | None = None) -> None:
        """:meth:`read` done on the calling thread, for a caller that would only wait for it (a reader
        thread of its own, as ZeRO-Inference's): the same calls, checks, errors and counters, without
        the hop to a worker (a thread wake-up per read, which a loaded host delays)."""
        view = self._checked_view(f, t, offset)
        if len(view):
            self._move(f, view, offset, False, len(view) if need is None else need, t)

    def _checked_view(self, f: AioFile, t: torch.Tensor, offset: int) -> memoryview:
        view = _byte_view(t)
        n = len(view)
        if f.direct and (offset % ALIGN or n % ALIGN or t.data_ptr() % ALIGN):
            raise ValueError(f"{f.path}: direct I/O needs the address, offset ({offset}) and length ({n}) "
                             f"aligned to {ALIGN} bytes (use shardwise.aio.AlignedBuffer)")
        return view

    def _submit(self, f: AioFile, t: torch.Tensor, offset: int, write: bool, need: int | None = None) -> IOHandle:
        view = self._checked_view(f, t, offset)
        n = len(view)
        need = n if need is None else need
        parts = min(self.config.intra_op_parallelism, max(1, n // ALIGN))
        step = align_up(-(-n // parts))
        futures = [self._pool.submit(self._move, f, view[a:min(n, a + step)], offset + a, write,
                                     min(max(need - a, 0), step), t)
                   for a in range(0, n, step)] if n else []
        return IOHandle(futures)

    def _move(self, f: AioFile, view: memoryview, offset: int, write: bool, need: int,
              keep: torch.Tensor) -> None:  # noqa: ARG002 - ``keep``: the tensor under ``view``, alive until done
        """One worker's part: calls of ``call_bytes`` at most, each ``queue_depth`` blocks; a read may
        stop at the end of the file once ``need`` bytes are in."""
        kind = "write" if write else "read"
        with self._lock:
            self._track(kind, True)
        try:
            self._transfer(f, view, offset, write, need)
        finally:
            with self._lock:
                self._track(kind, False)
                if write:
                    self.bytes_written += len(view)
                else:
                    self.bytes_read += len(view)

    def _transfer(self, f: AioFile, view: memoryview, offset: int, write: bool, need: int) -> None:
        block, call = self.config.block_size, self.config.call_bytes
        done, n = 0, len(view)
        while done < n:
            chunk = view[done:min(n, done + call)]
            iov = [chunk[i:i + block] for i in range(0, len(chunk), block)]
            try:
                got = (os.pwritev if write else os.preadv)(f.fd, iov, offset + done)
            except OSError as e:
                what = "write" if write else "read"
                raise AioError(f"{f.path}: {what} of {len(chunk)} bytes at offset {offset + done} "
                               f"failed: {e.strerror}") from None
            if got <= 0 and not write and done >= need:
                break
            if got <= 0:
                raise AioError(f"{f.path}: the file ends at byte {offset + done}, {offset + need} expected: "
                               "truncated, or not the file that was written")
            done += got
        if write:
            drop_cached(f, offset, n)


_SHARED: dict[int, IOEngine] = {}  # process id -> its engine (a forked child's threads are not its parent's)
_SHARED_LOCK = threading.Lock()


def shared_engine() -> IOEngine:
    """The process's engine for reads that have no run configuration of their own (ZeRO-Inference's disk
    tier, through ``files.safetensors_io.read_into``): made when first needed (again in a forked child,
    which has none of its parent's threads), closed at exit. Its ``bytes_read`` and ``busy["read"]`` are
    those reads' totals."""
    pid = os.getpid()
    with _SHARED_LOCK:
        if pid not in _SHARED:
            _SHARED.clear()
            _SHARED[pid] = IOEngine(AioConfig())
            atexit.register(_SHARED[pid].close)
        return _SHARED[pid]
