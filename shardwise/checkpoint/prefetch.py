"""A load's shard files read whole through the I/O engine (``shardwise/aio``), several in flight.

Why: the streaming reader reads every file twice (a sha256 pass over the whole file, then a ``pread``
per slice), on the loading thread, one file after another. Here each file this rank needs is read
once, in chunks queued on the engine's threads (``preadv``, the GIL released), while another thread
hashes the chunks already in: reading and hashing overlap, within a file and across files. The load
then copies its slices out of memory, and the bytes it uses are the bytes that were hashed.

Bounded: a file's size is checked against the metadata before its buffer is allocated, and the files
read this way hold at most ``budget`` bytes together (default: half of ``MemAvailable``); the others
are read by the streaming path as before. docs/checkpoints.md has the measurements.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from shardwise.aio import AioConfig, AioError, AlignedBuffer, IOEngine, open_file
from shardwise.checkpoint.format import CheckpointError

CHUNK = 32 << 20  # bytes per read request: hashing starts once the first chunk is in
HASHERS = 4  # files hashed at once (hashlib releases the GIL on large buffers)
IO = AioConfig(block_size=1 << 20, queue_depth=8, intra_op_parallelism=4)


def mem_available() -> int:
    """``MemAvailable`` from /proc/meminfo in bytes (1 GiB where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 30


def choose(sizes: dict[str, int], budget: int | None = None) -> list[str]:
    """The files (in the given order) read whole: as many as fit in ``budget`` bytes together."""
    budget = mem_available() // 2 if budget is None else budget
    out, total = [], 0
    for name, size in sizes.items():
        if total + size <= budget:
            out.append(name)
            total += size
    return out


def _read_and_hash(io: IOEngine, path: Path, size: int, want: str | None) -> torch.Tensor:
    """``path``'s ``size`` bytes as a uint8 tensor: chunk reads queued on the engine, hashed in order as
    they arrive; a short file or another sha256 than ``want`` (None: not checked) is a CheckpointError."""
    buf = AlignedBuffer(size)
    f = open_file(path, write=False)
    try:
        handles = [io.read(f, buf.tensor[a:a + CHUNK], offset=a, need=max(0, min(CHUNK, size - a)))
                   for a in range(0, buf.nbytes, CHUNK)]
        h = hashlib.sha256()
        for a, handle in zip(range(0, buf.nbytes, CHUNK), handles, strict=True):
            try:
                handle.wait()
            except AioError as e:
                for rest in handles:  # nothing left writing into the buffer once this returns
                    _quiet_wait(rest)
                raise CheckpointError(f"{path}: cannot read: {e}") from e
            if want is not None:
                h.update(memoryview(buf.tensor[a:min(size, a + CHUNK)].numpy()))
    finally:
        f.close()
    if want is not None and h.hexdigest() != want:
        raise CheckpointError(f"{path}: sha256 mismatch, the file is corrupt")
    return buf.tensor[:size]


def _quiet_wait(handle) -> None:
    try:
        handle.wait()
    except OSError:
        pass  # the first error is the one raised


def read_files(paths: dict[str, Path], sizes: dict[str, int], hashes: dict[str, str | None],
               io_config: AioConfig = IO) -> dict[str, torch.Tensor]:
    """Every file of ``paths`` read whole (its ``sizes`` already checked against the metadata) and
    hashed against ``hashes``; several in flight. The first failure is raised, naming its file."""
    out: dict[str, torch.Tensor] = {}
    with IOEngine(io_config) as io, ThreadPoolExecutor(min(HASHERS, max(1, len(paths))),
                                                       thread_name_prefix="shardwise-load") as pool:
        job: Callable[[str], torch.Tensor] = lambda n: _read_and_hash(io, paths[n], sizes[n], hashes[n])  # noqa: E731
        futures = {name: pool.submit(job, name) for name in paths}
        errors = []
        for name, fut in futures.items():
            try:
                out[name] = fut.result()
            except BaseException as e:  # noqa: BLE001 - every future awaited, then the first raised
                errors.append(e)
    if errors:
        raise errors[0]
    return out


def copy_out(mem: torch.Tensor, offset: int, dtype: torch.dtype, dst: torch.Tensor) -> None:
    """``dst.numel()`` elements of ``dtype`` from byte ``offset`` of ``mem`` into ``dst`` (converted to its
    dtype as the streaming reader converts: ``copy_``)."""
    n = dst.numel() * dtype.itemsize
    raw = mem[offset:offset + n]
    if offset % dtype.itemsize:  # safetensors keeps no alignment between tensors of different dtypes
        raw = raw.clone()
    dst.view(-1).copy_(raw.view(dtype))
