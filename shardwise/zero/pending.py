"""Work in flight: shard reads on the reader thread, and the bound on pending gradient reductions."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class ReadWork:
    """A shard read running on the reader thread (offload="disk" prefetch); ``wait()`` joins it."""

    def __init__(self, future: Future):
        self._future = future

    def wait(self) -> None:
        self._future.result()


_POOL: list[ThreadPoolExecutor] = []


def read_pool() -> ThreadPoolExecutor:
    """One reader thread per process: reads stay in order, one stream from the disk."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-read"))
    return _POOL[0]


class InflightLimit:
    """At most ``limit`` gradient buckets reduce asynchronously at once.

    Each pending reduction keeps buffers alive (at stage >= 2 its full-size bucket, on gloo its
    ring's receive chunk); without a bound every bucket of the model would still be held when
    backward ends (4 bytes x params in fp32 at stage 2).
    """

    def __init__(self, limit: int = 2):
        self.limit = limit
        self._queue: deque[Any] = deque()  # ShardedGroups

    def admit(self, group: Any) -> None:
        self._queue.append(group)
        while len(self._queue) > self.limit:
            self._queue.popleft().wait()
