"""The one place a rank's shard file is written: sha256 on the way, fsync at the end.

A seam on purpose: the synchronous save and the background writer (``checkpoint/async_save.py``)
both call :func:`write_shard`; the sha256 and the byte count it returns are what ``metadata.json``
records, whoever writes. Two bodies, chosen by :data:`ENGINE`: plain buffered writes
(``SafetensorsWriter``), or ``shardwise/aio``'s engine (:func:`write_shard_engine`: the bytes copied
into a ring of aligned chunks, each hashed, then written by the engine's threads with ``pwritev``,
``O_DIRECT`` where the filesystem takes it, while the next chunk fills). docs/checkpoints.md has
the measurements that chose the default.

:func:`at_phase` is a test seam: the crash-consistency tests replace it to SIGKILL a rank when a
save reaches a phase (``staging``, ``writing``, ``fsync``, ``publishing``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from shardwise.aio import AioConfig, AioError, AioFile, AlignedBuffer, IOEngine, IOHandle, align_up, open_file
from shardwise.checkpoint.deferred import Deferred, resolve
from shardwise.checkpoint.fileio import SafetensorsWriter, check_planned, safetensors_header

PHASES = ("staging", "writing", "fsync", "publishing")
ENGINE = True  # False: the buffered writer (slower in docs/checkpoints.md; the benchmark's baseline)
CHUNK = 8 << 20  # bytes a write request carries
RING = 4  # chunks: one filling, the others being written
IO = AioConfig(block_size=1 << 20, queue_depth=8, intra_op_parallelism=2)


def at_phase(phase: str) -> None:
    """Test seam, called when a save reaches ``phase`` (one of :data:`PHASES`); does nothing."""


def write_shard(path: Path, pieces: list[tuple[str, torch.Tensor | Deferred]]) -> tuple[str, int]:
    """One safetensors file of ``pieces`` (host tensors that nothing overwrites meanwhile, or
    ``checkpoint/deferred.py``'s pieces, read as the writer reaches them), flushed and fsynced; returns
    (sha256 hex, size in bytes)."""
    if ENGINE:
        return write_shard_engine(path, pieces)
    w = SafetensorsWriter(path, [(k, t.dtype, tuple(t.shape)) for k, t in pieces])
    for i, (k, t) in enumerate(pieces):
        w.write(k, resolve(t))  # inline: a deferred piece's bytes are dropped once written
        if i == 0:
            at_phase("writing")
    at_phase("fsync")
    return w.close()


def _write_now(f: AioFile, chunk: torch.Tensor, offset: int) -> None:
    """``chunk`` written at ``offset`` on this thread (the engine's threads cannot start at exit)."""
    view, done = memoryview(chunk.numpy()), 0
    while done < len(view):
        n = os.pwritev(f.fd, [view[done:]], offset + done)
        if n <= 0:
            raise AioError(f"{f.path}: write of {len(view) - done} bytes at offset {offset + done} wrote nothing")
        done += n


class _Ring:
    """Bytes appended into aligned chunks; a full chunk is hashed and handed to the engine, and its
    buffer is reused only once that write is done (nothing overwrites a buffer being written)."""

    def __init__(self, io: IOEngine, f: AioFile):
        self.io, self.f, self.sha = io, f, hashlib.sha256()
        self.bufs = [AlignedBuffer(CHUNK) for _ in range(RING)]
        self.handles: list[IOHandle | None] = [None] * RING
        self.slot = self.fill = self.pos = 0

    def put(self, src: torch.Tensor) -> None:
        i, n = 0, src.numel()
        while i < n:
            k = min(CHUNK - self.fill, n - i)
            self.bufs[self.slot].tensor[self.fill:self.fill + k].copy_(src[i:i + k])
            self.fill, i = self.fill + k, i + k
            if self.fill == CHUNK:
                self._flush()

    def _flush(self) -> None:
        buf = self.bufs[self.slot].tensor
        self.sha.update(memoryview(buf[:self.fill].numpy()))
        # a direct write moves whole blocks: the last chunk's tail past the data is cut off by finish()
        chunk = buf[:align_up(self.fill)]
        try:
            self.handles[self.slot] = self.io.write(self.f, chunk, offset=self.pos)
        except RuntimeError:  # at interpreter exit (a pending save completed) no thread can start
            _write_now(self.f, chunk, self.pos)
        self.pos, self.fill, self.slot = self.pos + self.fill, 0, (self.slot + 1) % RING
        self.wait(self.slot)

    def wait(self, slot: int) -> None:
        handle, self.handles[slot] = self.handles[slot], None
        if handle is not None:
            handle.wait()

    def finish(self) -> tuple[str, int]:
        if self.fill:
            self._flush()
        for slot in range(RING):
            self.wait(slot)
        return self.sha.hexdigest(), self.pos


def write_shard_engine(path: Path, pieces: list[tuple[str, torch.Tensor | Deferred]]) -> tuple[str, int]:
    """:func:`write_shard` through ``shardwise/aio``: the same bytes, sha256 and size; fsynced."""
    head, _ = safetensors_header([(k, t.dtype, tuple(t.shape)) for k, t in pieces])
    Path(path).unlink(missing_ok=True)  # a fresh file (a symlink at the name is removed, never followed)
    f = open_file(path, write=True)
    try:
        with IOEngine(IO) as io:  # leaving it waits for every write in flight, also on an error
            ring = _Ring(io, f)
            ring.put(torch.frombuffer(bytearray(head), dtype=torch.uint8))
            for i, (_, t) in enumerate(pieces):
                ring.put(resolve(t).detach().reshape(-1).contiguous().cpu().view(torch.uint8))
                if i == 0:
                    at_phase("writing")
            sha, size = ring.finish()
        at_phase("fsync")
        f.truncate(size)
        f.sync()
    finally:
        f.close()
    return sha, size


def safetensors_writer(path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> Any:
    """A streaming safetensors writer for an HF export file: :class:`EngineSafetensorsWriter`, or the
    buffered ``SafetensorsWriter`` when :data:`ENGINE` is off (the same switch as a shard's)."""
    return EngineSafetensorsWriter(path, specs) if ENGINE else SafetensorsWriter(path, specs)


class EngineSafetensorsWriter:
    """:class:`~shardwise.checkpoint.fileio.SafetensorsWriter`'s contract (tensors appended in the planned
    order, ``close()`` returns sha256 and size, fsynced) through ``shardwise/aio``, as
    :func:`write_shard_engine` writes a checkpoint shard: HF exports and ``shardwise consolidate`` stream
    one tensor at a time through it (``checkpoint/hf.py``)."""

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        head, self._order = safetensors_header(specs)
        self.path, self._next = Path(path), 0
        self.path.unlink(missing_ok=True)  # a fresh file (a symlink at the name is removed, never followed)
        # made here with the permissions (under the umask) of the buffered writer's files, then opened
        os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
        self.f = open_file(self.path, write=True)
        self.io = IOEngine(IO)
        self.ring = _Ring(self.io, self.f)
        self.ring.put(torch.frombuffer(bytearray(head), dtype=torch.uint8))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        check_planned(self.path, self._order[self._next], name, tensor)
        self.ring.put(tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8))
        self._next += 1

    def close(self) -> tuple[str, int]:
        """Every write waited for, the file cut to its size and fsynced; (sha256 hex, size in bytes)."""
        if self._next != len(self._order):
            raise ValueError(f"{self.path.name}: {len(self._order) - self._next} planned tensors unwritten")
        try:
            sha, size = self.ring.finish()
            self.io.close()
            self.f.truncate(size)
            self.f.sync()
        finally:
            self.abort()
        return sha, size

    def abort(self) -> None:
        """Stop the engine (waiting for its writes) and close the file (idempotent; the caller removes it)."""
        self.io.close()
        self.f.close()
