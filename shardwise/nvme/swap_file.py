"""One swap file: a group's master shard and its optimizer state, laid out for direct I/O, checked on read.

A file (and the host buffer it is read into) is a header block followed by one slot per tensor, each
starting on an :data:`~shardwise.aio.ALIGN` boundary: the master first, then the optimizer's
per-element state (``exp_avg``, ``exp_avg_sq``, ... in the order :func:`state_keys` found them). The
whole file moves in one request, so a read or a write is one sequential transfer.

The header carries a generation stamp (incremented by every write of this run, and kept in memory)
and a checksum of the slots (the sum of their bytes as int64 words: one pass at memory speed, which
any single changed word changes). A read that finds the file shorter than written, another stamp, or another
sum is an :class:`SwapFileError` naming the file: never garbage handed to the optimizer.

A parameter swap file (``param_store.py``) carries the same kind of header (:data:`PARAM_MAGIC`): its
data, written piece by piece through the bounce buffers, starts at :data:`~shardwise.aio.ALIGN`, and its
checksum is the sum of the pieces' sums (the int64 sum is additive over aligned pieces).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardwise.aio import ALIGN, AioError, align_up

MAGIC = b"SWNVME01"
PARAM_MAGIC = b"SWPARAM1"
_HEADER = struct.Struct("<8sQQQq")  # magic, generation, file bytes (a parameter file: data bytes), has_state, checksum


class SwapFileError(AioError):
    """A swap file is not what this run wrote (truncated, stamped by another write, bytes changed)."""


@dataclass(frozen=True)
class Slot:
    key: str  # "master" or the optimizer state's key
    dtype: torch.dtype
    offset: int  # bytes from the start of the file
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()


@dataclass
class SwapLayout:
    """Where each tensor of one group sits in its file (and buffer)."""

    path: Path
    slots: list[Slot]
    generation: int = 0
    has_state: bool = False  # the optimizer state is in the file (after the first step)
    sizes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(cls, path: Path, numel: int, master_dtype: torch.dtype,
              states: list[tuple[str, torch.dtype]]) -> SwapLayout:
        slots, offset = [], ALIGN
        for key, dtype in [("master", master_dtype), *states]:
            slot = Slot(key, dtype, offset, numel)
            slots.append(slot)
            offset = align_up(offset + slot.nbytes)
        return cls(path, slots)

    @property
    def nbytes(self) -> int:
        """The whole file: header and every slot (the state slots are written from the first step on)."""
        last = self.slots[-1]
        return align_up(last.offset + last.nbytes)

    @property
    def master_nbytes(self) -> int:
        """The file before the first step: header and master only."""
        return align_up(self.slots[0].offset + self.slots[0].nbytes)

    def used(self) -> int:
        return self.nbytes if self.has_state else self.master_nbytes


def checksum(data: torch.Tensor) -> int:
    """The sum of ``data``'s bytes read as int64 words, modulo 2**64 (an integer sum wraps the same in any
    order, so it is exact and deterministic; ~20 GB/s on one core, where an int32 sum widened to int64
    ran at 1.3 GB/s and took most of a step)."""
    return int(data.view(torch.int64).sum())


def put_header(buf: torch.Tensor, magic: bytes, generation: int, nbytes: int, flag: int, total: int) -> None:
    """The header block written into the first :data:`ALIGN` bytes of ``buf`` (the rest of the block zeroed)."""
    head = _HEADER.pack(magic, generation, nbytes, flag, total)
    buf[:ALIGN].zero_()
    buf[:len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))


def check_header(where: str, buf: torch.Tensor, magic: bytes, generation: int, nbytes: int, flag: int) -> int:
    """The header in ``buf`` is ``magic``'s, of ``generation``, ``nbytes`` and ``flag``, or SwapFileError
    naming ``where``; returns the checksum it records."""
    found, gen, size, has, total = _HEADER.unpack(bytes(buf[:_HEADER.size].numpy()))
    if found != magic:
        raise SwapFileError(f"{where} has no shardwise header (overwritten or not a swap file)")
    if gen != generation or size != nbytes or has != flag:
        raise SwapFileError(f"{where} is generation {gen} of {size} bytes, this run wrote generation "
                            f"{generation} of {nbytes} bytes (a stale copy, or changed underneath)")
    return total


def stamp(layout: SwapLayout, buf: torch.Tensor) -> int:
    """Write the header of the next generation into ``buf`` (the slots are filled); returns the bytes to write."""
    n = layout.used()
    layout.generation += 1
    put_header(buf, MAGIC, layout.generation, n, int(layout.has_state), checksum(buf[ALIGN:n]))
    return n


def check(layout: SwapLayout, buf: torch.Tensor) -> None:
    """``buf`` holds what the last write of ``layout`` put in the file, or SwapFileError naming it."""
    n = layout.used()
    where = f"{layout.path}: swap file"
    total = check_header(where, buf, MAGIC, layout.generation, n, int(layout.has_state))
    if checksum(buf[ALIGN:n]) != total:
        raise SwapFileError(f"{where} fails its checksum: its bytes changed after they were written")
