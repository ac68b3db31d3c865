"""Parameters on NVMe (ZeRO-Infinity's ``offload_param.device: nvme``): a stage-3 store whose shard lives
in a swap file, read back at every gather (ahead of use: the fetcher's prefetch runs the read on the reader
thread at one rank; at several the read runs at the prefetch, its all-gather after it: see
``reads_ahead_of_gather``) and rewritten when the parameters change (a
step, an edit, a load: on the writer thread, behind the step, ``ParamSwap.queue_write``).

``max_in_cpu`` elements of shards stay in host memory (the first groups built, as a resident copy), the
rest go to files; every transfer passes through ``buffer_count`` aligned bounce buffers of ``buffer_size``
elements (a shard larger than one moves in pieces), so the host holds at most ``max_in_cpu`` elements and
the bounce buffers. The file holds the 16-bit shard bit for bit, so a gather gives CPU parameter offload's
values exactly. A trainable group's checkpoint is its master; this store is never read for it.

A file is a header block (``swap_file.put_header``: magic, generation, the shard's bytes, checksum) and the
shard from byte :data:`~shardwise.aio.ALIGN` on, each piece padded with zeros to a whole block. Every write
of the shard stamps the next generation (kept in memory too) after its pieces; every read checks the header
and the sum of the pieces it read, so a truncated, stale or changed file is a :class:`SwapFileError` naming
it, never parameters made of garbage.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from shardwise.aio import ALIGN, AlignedBuffer, IOEngine, align_up, open_file
from shardwise.nvme.folder import SwapFolder
from shardwise.nvme.swap_file import PARAM_MAGIC, SwapFileError, check_header, checksum, put_header
from shardwise.zero.pending import ReadWork, read_pool
from shardwise.zero.store import ShardStore


class ParamSwap:
    """What the stores of one model share: the folder, the I/O engine, the bounce buffers, the budget."""

    def __init__(self, folder: SwapFolder, io: IOEngine, buffer_count: int, buffer_size: int, max_in_cpu: int):
        self.folder, self.io, self.max_in_cpu = folder, io, max_in_cpu
        self.in_cpu = 0  # shard elements kept resident so far
        self.bounce: queue.Queue[AlignedBuffer] = queue.Queue()
        self.buffer_bytes = align_up(2 * buffer_size)  # 16-bit elements (4 bytes for an fp32 model: pieces)
        self.buffers = max(1, buffer_count)
        self.made: list[AlignedBuffer] = []  # made when first needed, no larger than the largest shard
        self.largest = 0  # bytes of the largest shard kept so far
        self.lock = threading.Lock()
        self.stores: list[NvmeParamStore] = []
        # the overlap, measured: seconds the gathering thread waited for shard reads (a read needed now,
        # or a read-ahead not finished when its layer came), against the seconds reads were in flight
        # (``io.busy["read"]``); seconds the step's writes took (on the stepping thread)
        self.waits = {"read_wait": 0.0, "reads": 0, "ahead": 0, "write": 0.0}
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="shardwise-param-write")
        self.last: Future | None = None  # the write queued last
        self.in_flight: deque[Future] = deque()  # writes queued, oldest first

    def take(self) -> AlignedBuffer:
        """A bounce buffer: a free one, a new one while fewer than ``buffer_count`` exist, else the next freed."""
        with self.lock:
            if self.bounce.empty() and len(self.made) < self.buffers:
                self.made.append(AlignedBuffer(min(self.buffer_bytes, align_up(self.largest))))
                return self.made[-1]
        return self.bounce.get()

    def store(self) -> NvmeParamStore:
        self.stores.append(NvmeParamStore(self, self.folder.file(f"param{len(self.stores):05d}.swap")))
        return self.stores[-1]

    def host_bytes(self) -> int:
        """Bounce buffers and the shards kept in host memory (``max_in_cpu``)."""
        return self.bounce_bytes() + sum(s.nbytes for s in self.stores)

    def bounce_bytes(self) -> int:
        return sum(b.nbytes for b in self.made)

    def disk_bytes(self) -> int:
        """The shards in files (their headers and block padding not counted)."""
        return sum(s.numel * s.dtype.itemsize for s in self.stores if s.file is not None)

    def queue_write(self, store: NvmeParamStore, data: torch.Tensor) -> Future:
        """``store``'s new shard (a host tensor of its own) written on the writer thread, in order: at most
        ``buffer_count`` writes in flight (the oldest waited for first), overlapping what the stepping
        thread does next (the next groups' publish, the next forward), so at most ``buffer_count + 1``
        shards are in transit on the host."""
        while len(self.in_flight) >= self.buffers:
            wait([self.in_flight.popleft()])
        prev = self.last
        # a failed write fails every write queued after it, so each of those stores' reads raises it too
        # (never a store left holding its previous, stale, generation as if current)
        self.last = self.writer.submit(store.write_now, data, prev)
        self.in_flight.append(self.last)
        return self.last

    def close(self) -> None:
        """Wait for the transfers, close and remove the files, release the lock (idempotent); a failed
        write no read has met yet is raised after the cleanup."""
        self.writer.shutdown(wait=True)
        self.io.close()
        for s in self.stores:
            if s.file is not None:
                s.file.close()
        self.folder.close()
        last, self.last = self.last, None
        if last is not None and last.exception() is not None:
            raise last.exception()


class TimedRead(ReadWork):
    """A read-ahead on the reader thread; :meth:`wait` adds the seconds it blocked to ``waits``."""

    def __init__(self, future: Any, waits: dict):
        super().__init__(future)
        self.waits = waits

    def wait(self) -> None:
        t0 = time.perf_counter()
        try:
            super().wait()
        finally:
            self.waits["read_wait"] += time.perf_counter() - t0
            self.waits["reads"] += 1


class NvmeParamStore(ShardStore):
    """A stage-3 shard in a swap file (or, within ``max_in_cpu``, in host memory)."""

    rereads = True  # no resident shard to compare with or to quantize from
    # several ranks: True reads a prefetched shard on the reader thread and all-gathers when the gather is
    # waited for (zero/pending.ReadThenGather); off, the read runs on the main thread at the prefetch and the
    # all-gather after it is asynchronous. Off by default: at two CPU ranks the step took 1.79-2.32 s with it
    # and 1.02-1.52 s without, in three pairs of runs (the all-gathers lose their overlap; docs/offload.md,
    # bench_nvme.py --param-read-then-gather). One rank always reads ahead on the reader thread.
    reads_ahead_of_gather = False
    writable = True  # a trainable group may use it: update() rewrites the file

    def __init__(self, swap: ParamSwap, path: Any):
        super().__init__(None)
        self.swap, self.path, self.file = swap, path, None
        self.numel, self.dtype = 0, torch.bfloat16
        self.generation = 0  # of the file's last write (its header says the same)
        self.pending: Future | None = None  # the write queued last (write-behind), waited for by reads
        self.unwritten: torch.Tensor | None = None  # its data while the write is not done (reads copy it)

    def keep(self, group: Any, owned: torch.Tensor | None) -> None:
        self.numel, self.dtype = group.own_numel, group.dtype
        self.swap.largest = max(self.swap.largest, self.numel * owned.element_size())
        if self.swap.in_cpu + self.numel <= self.swap.max_in_cpu:
            self.swap.in_cpu += self.numel
            self.shard = torch.empty(self.numel, dtype=self.dtype)
            self.shard.copy_(owned)
            return
        self.file = open_file(self.path)
        self._write(owned)

    def fill(self, group: Any, owned: torch.Tensor, async_read: bool) -> ReadWork | None:  # noqa: ARG002
        if self.shard is not None:
            with torch.no_grad():
                owned.copy_(self.shard, non_blocking=True)
            return None
        if async_read:
            self.swap.waits["ahead"] += 1
            return TimedRead(read_pool().submit(self._read_after_write, owned), self.swap.waits)
        t0 = time.perf_counter()
        self._read_after_write(owned)
        self.swap.waits["read_wait"] += time.perf_counter() - t0
        self.swap.waits["reads"] += 1
        return None

    def update(self, src: torch.Tensor, non_blocking: bool = False) -> None:  # noqa: ARG002
        if self.shard is not None:
            self.shard.copy_(src)
        else:  # the master (fp32) rounded to the parameters' dtype, as a resident shard's copy_ rounds it
            t0 = time.perf_counter()
            # a host copy of its own, made here (a device's on this thread's stream): the caller may change
            # ``src`` (the next step) while the writer thread writes it
            data = src.detach().to("cpu", self.dtype, copy=True)
            self.unwritten = data
            self.pending = self.swap.queue_write(self, data)
            self.swap.waits["write"] += time.perf_counter() - t0

    def write_now(self, data: torch.Tensor, prev: Future | None) -> None:
        """On the writer thread: ``data`` into the file, the next generation stamped (``prev``'s error,
        the write queued before, raised instead)."""
        try:
            if prev is not None:
                prev.result()
            self._write(data)
        finally:
            if self.unwritten is data:
                self.unwritten = None  # the host copy goes with the write (a read holding it keeps its own)

    def _read_after_write(self, dst: torch.Tensor) -> None:
        """The new shard copied from its write's host copy while that write is not done (no wait, no disk
        read: the bytes the file will hold); else the last write's error raised (the file is not what it
        should hold), then the file read."""
        data = self.unwritten
        if data is not None:  # the new shard is still on its way to the disk: its bytes, not the file's
            with torch.no_grad():
                dst.copy_(data)
            return
        if self.pending is not None:
            self.pending.result()
        self._read(dst)

    @property
    def nbytes(self) -> int:
        return 0 if self.shard is None else self.shard.numel() * self.shard.element_size()

    def _pieces(self, t: torch.Tensor):
        """(bounce buffer, its bytes view, piece of ``t`` as bytes, file offset) per piece, each buffer
        given back after its piece."""
        flat = t.detach().reshape(-1).view(torch.uint8)
        off = 0
        while off < flat.numel():
            buf = self.swap.take()
            try:
                piece = flat[off:off + buf.nbytes]
                yield buf, buf.tensor[:align_up(piece.numel())], piece, off
            finally:
                self.swap.bounce.put(buf)
            off += piece.numel()

    @torch.no_grad()
    def _write(self, src: torch.Tensor) -> None:
        """The pieces at ``ALIGN + offset``, then the header of the next generation with their sum."""
        total = 0
        for _buf, view, piece, off in self._pieces(src):
            view[:piece.numel()].copy_(piece)  # (a device tensor is copied to the host here)
            view[piece.numel():].zero_()  # the block's padding: the same bytes in the file and its sum
            total = wrap_sum(total + checksum(view))
            self.swap.io.write(self.file, view, ALIGN + off).wait()
        buf = self.swap.take()
        try:
            put_header(buf.tensor, PARAM_MAGIC, self.generation + 1, self.numel * self.dtype.itemsize, 0, total)
            self.swap.io.write(self.file, buf.tensor[:ALIGN], 0).wait()
        finally:
            self.swap.bounce.put(buf)
        self.generation += 1

    @torch.no_grad()
    def _read(self, dst: torch.Tensor) -> None:
        """The pieces into ``dst``; the header and the sum checked (SwapFileError naming the file)."""
        buf = self.swap.take()
        try:
            self.swap.io.read(self.file, buf.tensor[:ALIGN], 0).wait()
            where = f"{self.path}: parameter swap file"
            want = check_header(where, buf.tensor, PARAM_MAGIC, self.generation, self.numel * self.dtype.itemsize, 0)
        finally:
            self.swap.bounce.put(buf)
        total = 0
        for _buf, view, piece, off in self._pieces(dst):
            self.swap.io.read(self.file, view, ALIGN + off).wait()
            total = wrap_sum(total + checksum(view))
            piece.copy_(view[:piece.numel()])
        if total != want:
            raise SwapFileError(f"{where} fails its checksum: its bytes changed after they were written")


def wrap_sum(total: int) -> int:
    """``total`` as the signed 64-bit integer torch's int64 sum wraps to (sums of pieces add up to the whole's)."""
    return (total + (1 << 63)) % (1 << 64) - (1 << 63)
