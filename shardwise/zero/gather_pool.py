"""A fixed set of buffers that frozen stage-3 groups (streamed inference) are gathered into."""

from __future__ import annotations

import torch


class PoolFull(RuntimeError):
    """A gather that must happen now found every buffer taken, and nothing could be made free."""


class GatherPool:
    """Fixed buffers that gathered units are filled into, allocated once and reused; never more.

    Streaming a layer per gather through the allocator leaves RSS to glibc's heuristics: a
    freed layer-sized block may go back to the OS or stay in the heap, so the same run grew
    RSS by 24-40% of the model on some runs and 15% on others. With ``slots`` buffers of the
    largest unit's size made (and touched) at start, the gathered bytes are these buffers and
    nothing else, on every run, however the threads are scheduled: when no buffer is free,
    :meth:`acquire` returns None and the caller waits for one (a prefetch is put off until a
    unit is released; a gather needed now first releases a unit that was only read ahead, see
    ``ParamFetcher.make_room``). It never allocates a buffer of its own. Only frozen groups use
    it: a training group's backward re-gathers into the storage its forward views were saved
    from (see ``ShardedGroup.release``).
    """

    def __init__(self, slots: int, slot_bytes: int, device: torch.device):
        self.slot_bytes = slot_bytes
        # zeros, not empty: every page is touched here, so the pool is resident from the load on and
        # a generation's peak does not depend on when a slot is first written
        self._free = [torch.zeros(slot_bytes, dtype=torch.uint8, device=device) for _ in range(slots)]
        self._slots = {b.data_ptr(): b for b in self._free}
        self.slots = slots
        self.deferred = 0  # prefetches put off because every buffer was taken

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def free(self) -> int:
        """Buffers not holding a unit now."""
        return len(self._free)

    def holds(self, buf: torch.Tensor) -> bool:
        """Is ``buf`` a view of one of the pool's buffers?"""
        return buf.numel() > 0 and buf.untyped_storage().data_ptr() in self._slots

    def acquire(self, dtype: torch.dtype, numel: int) -> torch.Tensor | None:
        """A free buffer viewed as ``numel`` elements of ``dtype``; None when all are taken."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > self.slot_bytes:
            raise ValueError(f"a unit of {nbytes} bytes does not fit the gather pool's {self.slot_bytes}-byte "
                             "buffers (the pool is sized from the largest layer at build)")
        if not self._free:
            return None
        return self._free.pop()[:nbytes].view(dtype)

    def give_back(self, buf: torch.Tensor) -> None:
        """Return a buffer from :meth:`acquire`."""
        slot = self._slots.get(buf.untyped_storage().data_ptr()) if buf.numel() else None
        if slot is not None and all(b is not slot for b in self._free):
            self._free.append(slot)
