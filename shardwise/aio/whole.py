"""A whole tensor to a file and back through the engine, aligned or not (a bounce buffer when not)."""

from __future__ import annotations

import os

import torch

from shardwise.aio.buffer import ALIGN, AlignedBuffer
from shardwise.aio.engine import IOEngine
from shardwise.aio.files import AioError, open_file


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGN == 0 and _nbytes(t) % ALIGN == 0


def write_tensor(io: IOEngine, path: str | os.PathLike, t: torch.Tensor, fsync: bool = True) -> None:
    """Write ``t``'s bytes as the file ``path`` (exactly ``t``'s size; fsynced unless ``fsync=False``)."""
    n = _nbytes(t)
    f = open_file(path, write=True)
    try:
        src = t.reshape(-1).view(torch.uint8)
        if f.direct and not _aligned(t):
            bounce = AlignedBuffer(n)
            bounce.tensor[:n].copy_(src)
            src = bounce.tensor
        io.write(f, src).wait()
        f.truncate(n)
        if fsync:
            f.sync()
    finally:
        f.close()


def read_tensor(io: IOEngine, path: str | os.PathLike, out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` from the file ``path``, which must hold exactly ``out``'s bytes (else AioError)."""
    n = _nbytes(out)
    f = open_file(path, write=False)
    try:
        if f.size() != n:
            raise AioError(f"{path}: {f.size()} bytes on disk, {n} expected: truncated or another file")
        dst = out.reshape(-1).view(torch.uint8)
        if f.direct and not _aligned(out):
            bounce = AlignedBuffer(n)
            io.read(f, bounce.tensor, need=n).wait()
            dst.copy_(bounce.tensor[:n])
        else:
            io.read(f, dst).wait()
    finally:
        f.close()
    return out
