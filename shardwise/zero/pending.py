"""Work in flight: shard reads on the reader thread, the bound on pending gradient reductions and
the stage >= 2 gradient buckets those reductions hold, reused from one backward to the next."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class ReadWork:
    """A shard read running on the reader thread (offload="disk" prefetch); ``wait()`` joins it."""

    def __init__(self, future: Future):
        self._future = future

    def wait(self) -> None:
        self._future.result()


class ReadThenGather:
    """A shard read ahead on the reader thread, then the all-gather that shares it (several ranks, a file
    store): the all-gather is issued when the gather is waited for, on the main thread and in the same
    program order on every rank, so the read overlaps compute and no collective runs off the main thread
    (the all-gather is then not overlapped: on a disk it is the shorter of the two)."""

    def __init__(self, read: ReadWork, all_gather: Callable[[], Any]):
        self._read, self._all_gather = read, all_gather

    def wait(self) -> None:
        self._read.wait()
        work = self._all_gather()
        if work is not None:
            work.wait()


_POOL: list[ThreadPoolExecutor] = []


def read_pool() -> ThreadPoolExecutor:
    """One reader thread per process: reads stay in order, one stream from the disk."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-read"))
    return _POOL[0]


class InflightLimit:
    """At most ``limit`` gradient buckets reduce asynchronously at once, and their buffers are reused.

    Each pending reduction keeps buffers alive (at stage >= 2 its full-size bucket, on gloo its
    ring's receive chunk); without a bound every bucket of the model would still be held when
    backward ends (4 bytes x params in fp32 at stage 2).

    A stage >= 2 bucket lives from its first gradient to the end of its reduce-scatter. Allocating
    it fresh each backward costs more than the copies into it: a bucket of tens of MiB is a fresh
    ``mmap`` whose every page faults on first touch (about 0.4 ms per MiB here, ~40 ms a step for
    three 25 MiB buckets). The bound means at most ``limit + 1`` buckets exist at once (one filling,
    ``limit`` reducing), so keeping that many finished ones for the next bucket adds nothing to
    backward's peak: :meth:`take_bucket` reuses the smallest free one that fits, :meth:`give_bucket`
    returns one. They stay between steps (at most ``limit + 1`` buckets, through the next forward):
    on the CPU only, where a freed block goes back to the OS. On CUDA the caching allocator already
    reuses freed blocks without a fault, and a pooled bucket would only keep the forward's
    activations from that memory, so buckets there are allocated and freed as before. At stage 3
    the end of every backward :meth:`settle` s: nothing is kept into the next forward, as FSDP2
    frees its reduce-scatter buffers after backward (stage 2 keeps them: its gradients and
    parameters are whole buffers already, and the reuse is what keeps it ahead of stage 1).
    """

    def __init__(self, limit: int = 2):
        self.limit = limit
        self._queue: deque[Any] = deque()  # ShardedGroups
        self._free: list[torch.Tensor] = []  # finished stage >= 2 buckets, whole (not narrowed)
        self._in_use = 0  # buckets taken and not given back (filling or reducing)
        self._keep = True  # give_bucket keeps a finished bucket for reuse (finish_completed(keep=False))

    @property
    def in_use(self) -> int:
        """Buckets taken and not given back (0 once a step's reductions are all waited for)."""
        return self._in_use

    @property
    def free_nbytes(self) -> int:
        """Bytes of finished buckets kept for the next backward (``memory_report()["comm_buffers"]``)."""
        return sum(b.numel() * b.element_size() for b in self._free)

    def admit(self, group: Any) -> None:
        self._queue.append(group)
        while len(self._queue) > self.limit:
            self._queue.popleft().wait()

    def make_room(self) -> None:
        """Before a stage-3 bucket starts filling: wait for the oldest pending reductions until fewer
        than ``limit`` remain, so a bucket fills beside ``limit - 1`` reducing ones (one at the default
        2), not ``limit`` (besides it only the root's, which fills from the head's gradient, the
        first of a backward, to the embedding's, the last).

        FSDP2 likewise holds one reduce-scatter input in flight while the next unit's backward runs,
        and waits for it before the next reduce-scatter. A wait here performs the same additions in
        the same order as the later wait would have (no number changes), only earlier: by the time
        a unit's first gradient arrives its predecessor's exchange has had a whole recomputed
        forward and a gradient to finish, so little overlap is lost, and a layer's bucket (2 bytes x
        its parameters in bf16) less is held through the backward's peak. Those whose exchange is
        already over are finished first (:meth:`finish_completed`), whatever their number, so the take
        reuses their buckets."""
        self.finish_completed()
        while len(self._queue) >= self.limit:
            self._queue.popleft().wait()

    def finish_completed(self, keep: bool = True) -> None:
        """Finish, oldest first, the pending reductions whose communication is already over.

        Their ``wait()`` is the one that would run later (the same additions in the same order, into
        the same buffers), so no number changes, and nothing unfinished is waited for, so no overlap
        is lost; but their buckets are handed on now, to be reused by the bucket about to be taken,
        instead of living beside it until ``limit`` reductions are pending. Stops at the first one
        still exchanging: reductions finish in the order they were admitted, as ``wait()`` s do.

        ``keep=False`` (a gradient hook of a bucket already filling, stage 3): the finished buckets are
        let go instead of kept for reuse, since the next take is a whole unit's backward away and a
        kept one would sit through this unit's peak. The rank that is ahead meets its predecessor's
        exchange unfinished at the take (the other rank has not sent yet) and finishes it here."""
        self._keep = keep
        try:
            while self._queue and self._queue[0].reductions_completed():
                self._queue.popleft().wait()
        finally:
            self._keep = True

    def take_bucket(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D buffer of at least ``numel`` elements (uninitialized: the caller fills or zeroes it)."""
        self._in_use += 1
        fits = [b for b in self._free if b.numel() >= numel and b.dtype == dtype and b.device == device]
        if not fits:
            return torch.empty(numel, dtype=dtype, device=device)
        best = min(fits, key=torch.Tensor.numel)
        self._drop(best)
        return best

    def give_bucket(self, bucket: torch.Tensor) -> None:
        """Keep a finished bucket (its reduction has completed) for the next one: at most ``limit + 1``
        buckets exist, free or not (the smallest free ones go first); CPU buckets only."""
        self._in_use = max(self._in_use - 1, 0)
        if bucket.device.type != "cpu" or not self._keep:
            return
        self._free.append(bucket)
        while self._free and len(self._free) + self._in_use > self.limit + 1:
            self._drop(min(self._free, key=torch.Tensor.numel))

    def settle(self) -> None:
        """End of a backward (stage 3): wait for every reduction still pending, then let go of the
        finished buckets, so none is held through the next forward. The waits do the same additions
        in the same order as the step's would (no number changes); only their time moves earlier."""
        while self._queue:
            self._queue.popleft().wait()
        self._free = []

    def _drop(self, bucket: torch.Tensor) -> None:
        """Take ``bucket`` out of the free list, by identity (``list.remove`` would compare values)."""
        self._free = [b for b in self._free if b is not bucket]
