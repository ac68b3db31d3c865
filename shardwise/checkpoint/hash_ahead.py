"""A load's shard files hashed ahead, on background threads, their bytes read through the I/O engine.

Why: the streaming reader verified a file (a sha256 pass over all of it) on the loading thread before
its first slice was read, one file after another, reading and hashing in turn. Here, when the load
starts, every file this rank needs is handed to :class:`Verifier`: its chunks are read by the
engine's threads (``preadv``, the GIL released), several files and several chunks in flight, and
hashed on other threads as they arrive, while the loading thread already reads its slices (``pread``
straight into the staged tensors, as before: no extra copy, no file-sized buffer). The load installs
nothing before :meth:`Verifier.wait` has every hash equal to the metadata's, so a corrupt file is
still refused by name with the engine unchanged.

Memory is bounded by construction: ``RING`` buffers of ``CHUNK`` bytes per file being hashed (at most
``HASHERS`` at once), allocated after the file's size was checked against the metadata. Reads go
through the page cache (no ``O_DIRECT``), so the slice reads find the pages the hash pass brought in.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from shardwise.aio import AioConfig, AioError, AlignedBuffer, IOEngine, IOHandle, open_file
from shardwise.checkpoint.format import CheckpointError

CHUNK = 8 << 20  # bytes per read request
RING = 4  # chunks in flight per file (read ahead of the hash)
HASHERS = 4  # files hashed at once (hashlib releases the GIL on large buffers)
IO = AioConfig(block_size=1 << 20, queue_depth=8, intra_op_parallelism=2)


def _settle(handles: list[IOHandle | None]) -> None:
    """Wait for every read still in flight (the buffers are not dropped under a running read)."""
    for h in handles:
        try:
            if h is not None:
                h.wait()
        except OSError:
            pass  # the first error is the one raised


def hash_file(io: IOEngine, path: Path, size: int, want: str) -> None:
    """sha256 of ``path``'s ``size`` bytes, read ``RING`` chunks ahead on the engine; another hash, or a
    file that ends early, is a CheckpointError naming it."""
    f = open_file(path, write=False, direct=False)
    bufs = [AlignedBuffer(min(CHUNK, size)) for _ in range(min(RING, -(-size // CHUNK)))]
    starts = list(range(0, size, CHUNK))
    handles: list[IOHandle | None] = [None] * len(bufs)

    def submit(k: int) -> None:
        n = min(CHUNK, size - starts[k])
        handles[k % len(bufs)] = io.read(f, bufs[k % len(bufs)].tensor[:n], offset=starts[k])

    h = hashlib.sha256()
    try:
        for k in range(len(bufs)):
            submit(k)
        for k, a in enumerate(starts):
            slot = k % len(bufs)
            handles[slot].wait()
            h.update(memoryview(bufs[slot].tensor[:min(CHUNK, size - a)].numpy()))
            handles[slot] = None
            if k + len(bufs) < len(starts):
                submit(k + len(bufs))
    except AioError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    finally:
        _settle(handles)
        f.close()
    if h.hexdigest() != want:
        raise CheckpointError(f"{path}: sha256 mismatch, the file is corrupt")


class Verifier:
    """Files hashed in the background: :meth:`start` one, :meth:`wait` for all (raising the first
    failure, in the order started); the threads are gone once ``wait`` returns or raises."""

    def __init__(self, io_config: AioConfig = IO):
        self._io = IOEngine(io_config)
        self._pool = ThreadPoolExecutor(HASHERS, thread_name_prefix="shardwise-hash")
        self._futures: list[Future] = []

    def start(self, path: Path, size: int, want: str) -> None:
        self._futures.append(self._pool.submit(hash_file, self._io, path, size, want))

    def wait(self) -> None:
        errors = []
        for fut in self._futures:
            try:
                fut.result()
            except BaseException as e:  # noqa: BLE001 - every file awaited, then the first failure raised
                errors.append(e)
        self._futures.clear()
        self._pool.shutdown(wait=True)
        self._io.close()
        if errors:
            raise errors[0]
