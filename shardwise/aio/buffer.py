"""Host buffers that direct I/O can read into and write from.

``O_DIRECT`` moves bytes between the disk and the caller's memory without the page cache, and so the
kernel asks that the buffer's address, the file offset and the length be multiples of the device's
logical block size (``EINVAL`` otherwise). An anonymous ``mmap`` starts on a page boundary, and
every length here is rounded up to :data:`ALIGN` (4096 bytes: the page, and a multiple of every
logical block size in use), so a buffer from :class:`AlignedBuffer` always qualifies. The memory is
the process's own (not the page cache), counted in its RSS while it exists and returned to the
kernel when the last tensor over it is gone (``munmap``), not kept by an allocator's cache: the
tensor holds the mapping, so a view that outlives :meth:`AlignedBuffer.close` still reads valid
memory (closing the mapping under it would leave a dangling pointer).
"""

from __future__ import annotations

import mmap

import torch

ALIGN = 4096  # bytes: offsets, lengths and addresses of every direct transfer are multiples of it


def align_up(nbytes: int, align: int = ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``align``."""
    return -(-int(nbytes) // align) * align


class AlignedBuffer:
    """``nbytes`` (rounded up to :data:`ALIGN`) of page-aligned host memory, seen as a uint8 tensor.

    ``view(dtype, offset, numel)`` gives a typed tensor over part of it (no copy); the optimizer
    steps such views in place. ``pin``: page-locked through the accelerator's allocator (its host
    allocations start on a page boundary too), so a copy to the device runs asynchronously.
    """

    def __init__(self, nbytes: int, pin: bool = False):
        self.nbytes = align_up(max(int(nbytes), 1))
        self._map: mmap.mmap | None = None
        if pin and torch.cuda.is_available():
            raw = torch.empty(self.nbytes + ALIGN, dtype=torch.uint8, pin_memory=True)
            skip = (-raw.data_ptr()) % ALIGN
            self.tensor = raw[skip:skip + self.nbytes]
        else:
            self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        if self.tensor.data_ptr() % ALIGN:
            raise RuntimeError(f"AlignedBuffer: address {self.tensor.data_ptr():#x} is not {ALIGN}-byte aligned")

    @property
    def address(self) -> int:
        return self.tensor.data_ptr()

    def view(self, dtype: torch.dtype, offset: int, numel: int) -> torch.Tensor:
        """``numel`` elements of ``dtype`` starting ``offset`` bytes in (a view: writes go to the buffer)."""
        size = numel * torch.empty(0, dtype=dtype).element_size()
        if offset < 0 or offset + size > self.nbytes:
            raise ValueError(f"AlignedBuffer.view: bytes [{offset}, {offset + size}) outside the buffer of "
                             f"{self.nbytes} bytes")
        return self.tensor[offset:offset + size].view(dtype)

    def close(self) -> None:
        """Drop this object's hold on the memory: it goes back to the kernel once no view of it is left."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self._map = None
