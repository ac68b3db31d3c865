"""A fixed set of buffers that frozen stage-3 groups (streamed inference) are gathered into."""

from __future__ import annotations

import torch


class GatherPool:
    """Fixed buffers that gathered units are filled into, allocated once and reused.

    Streaming a layer per gather through the allocator leaves RSS to glibc's heuristics: a
    freed layer-sized block may go back to the OS or stay in the heap, so the same run grew
    RSS by 24-40% of the model on some runs and 15% on others. With ``slots`` buffers of the
    largest unit's size made at start, the gathered bytes are these buffers and nothing else,
    on every run. Only frozen groups use it: a training group's backward re-gathers into the
    storage its forward views were saved from (see ``ShardedGroup.release``).
    """

    def __init__(self, slots: int, slot_bytes: int, device: torch.device):
        self.slot_bytes = slot_bytes
        self._free = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(slots)]
        self._slots = {b.data_ptr(): b for b in self._free}
        self.slots = slots
        self.overflow = 0  # gathers that found no free slot (a schedule holding more than planned)

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def acquire(self, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        """A free buffer viewed as ``numel`` elements of ``dtype`` (a fresh one if none is free)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if not self._free or nbytes > self.slot_bytes:
            self.overflow += 1
            return torch.empty(numel, dtype=dtype, device=device)
        return self._free.pop()[:nbytes].view(dtype)

    def give_back(self, buf: torch.Tensor) -> None:
        """Return a buffer from :meth:`acquire` (others are simply dropped)."""
        slot = self._slots.get(buf.untyped_storage().data_ptr()) if buf.numel() else None
        if slot is not None and all(b is not slot for b in self._free):
            self._free.append(slot)
