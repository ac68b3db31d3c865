"""Every NVMe-held group in host memory for a checkpoint, and an edit of the parameters written through
(the :class:`~shardwise.nvme.swapper.OptimizerSwapper`'s methods that read whole groups, not pieces).

A load reads each group's pieces into tensors of the group's own (the master and each state, whole, as CPU
offload holds them) and writes them back piece by piece after: the one time NVMe offload holds a whole
optimizer state on the host, as a load into CPU offload does. A save streams instead (:meth:`Resident.streamed`):
the checkpoint writer reads one group at a time as it reaches it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from shardwise.aio import AlignedBuffer

if TYPE_CHECKING:
    from shardwise.zero.flat_group import ShardedGroup


class Resident:
    """Mixed into ``OptimizerSwapper`` (which has the pieces, layouts and the read, fill, write, leave steps)."""

    @contextmanager
    def resident(self, write_back: bool):
        """Every group's master and state in host memory (tensors of their own) for the body: a save
        reads them, a load (``write_back``) writes them and they go back to disk after."""
        self.drop_prefetched()  # a load writes the files: a read issued before would be stale
        made: list[ShardedGroup] = []
        try:
            for _, g in self.units:
                self._load_group(g)
                made.append(g)  # only a group read and checked is written back (never its stand-ins)
            yield
        finally:
            for g in made:
                if write_back:
                    live, buf = self._group_tensors(g), self._scratch(g)
                    for u in self.by_group[id(g)]:
                        self._fill(u, buf, live)
                        self._write(u, buf)
                self._leave(g)

    @contextmanager
    def streamed(self):
        """A save: the groups stay on disk and :meth:`saved_slice` reads them for the writer, one group at a
        time in the file's order, so the save holds one group's master and state at most (none for a group
        stepped whole: it is read into a free swap buffer), never the whole optimizer state
        (``checkpoint/deferred.py``)."""
        self.drop_prefetched()  # a read-ahead buffer of the next step is not what the save reads
        self.streaming, self.current = True, None
        try:
            yield
        finally:
            self.streaming, self.current = False, None

    def swapped(self, g: ShardedGroup) -> bool:
        """``g``'s master and state are in its swap files now and :meth:`saved_slice` reads them (a save)."""
        return getattr(self, "streaming", False) and id(g) in self.by_group

    def saved_slice(self, g: ShardedGroup, key: str, offset: int, length: int) -> torch.Tensor:
        """Elements ``[offset, offset + length)`` of ``g``'s ``key`` ("master" or a state's key) as saved: ``g``
        read from its files (checked) unless it is the group read last, whose tensors go first."""
        if self.current is None or self.current[0] is not g:
            self.current = None  # the last group's tensors are dropped before the next one's are made
            self.current = (g, self._read_for_save(g))
        return self.current[1][key].narrow(0, offset, length)

    def _read_for_save(self, g: ShardedGroup) -> dict[str, torch.Tensor]:
        """``g``'s tensors by key for a save: views of a free swap buffer for a group stepped whole (no host
        memory of the save's own: nothing else uses the buffers during a save, and the writer copies out of
        them before the next group is read), or (a cut group) its pieces joined into tensors of their own."""
        us = self.by_group[id(g)]
        if len(us) > 1 or not self.free:
            return self._read_group(g)
        buf, layout = self.free[-1], self.layouts[us[0]]
        self._read(us[0], buf)
        slots = layout.slots if layout.has_state else layout.slots[:1]
        return {s.key: buf.view(s.dtype, s.offset, s.numel) for s in slots}

    def _scratch(self, g: ShardedGroup) -> AlignedBuffer:
        return AlignedBuffer(max(self.layouts[u].nbytes for u in self.by_group[id(g)]))

    @torch.no_grad()
    def _read_group(self, g: ShardedGroup) -> dict[str, torch.Tensor]:
        """``g``'s master and state read from its files into tensors of their own (a cut group's pieces
        joined), by key."""
        us, buf = self.by_group[id(g)], self._scratch(g)
        first = self.layouts[us[0]]
        slots = first.slots if first.has_state else first.slots[:1]
        whole = {s.key: torch.empty(g.own_numel, dtype=s.dtype) for s in slots}
        for u in us:
            self._read(u, buf)
            piece = self.pieces[u]
            for s in self.layouts[u].slots[:len(slots)]:
                whole[s.key].narrow(0, piece.start, piece.numel).copy_(buf.view(s.dtype, s.offset, s.numel))
        return whole

    def _load_group(self, g: ShardedGroup) -> None:
        """``g``'s master and state read from its files into tensors of their own, set as its live ones."""
        whole = self._read_group(g)
        g.master.set_(whole.pop("master"))
        if whole:
            self.optimizer.state[g.master].update(whole)

    @torch.no_grad()
    def overwrite_master(self, g: ShardedGroup, src: torch.Tensor) -> None:
        """``g``'s master becomes ``src`` (an edit of the parameters), in its swap files; the state stays."""
        self.drop_prefetched()
        buf = self._scratch(g)
        for u in self.by_group[id(g)]:
            self._read(u, buf)
            piece, slot = self.pieces[u], self.layouts[u].slots[0]
            buf.view(slot.dtype, slot.offset, piece.numel).copy_(src.narrow(0, piece.start, piece.numel))
            self._write(u, buf)

