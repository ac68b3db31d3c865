"""Where each parameter of a group lies in its flat buffer and in each rank's shard.

A group's parameters are laid end to end in one flat buffer, padded to a multiple of the world
size, and rank ``r`` owns the ``r``-th of ``world`` equal pieces. Every reader of shards needs the
same arithmetic ("which element range of which parameter falls in this range of the buffer"):
the group filling its shard from files, the checkpoint writer and reader, the sharded state dict
and the ``safe_get_*`` accessors. :class:`FlatLayout` is its one owner, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Segment:
    """The part of parameter ``index`` inside a range of the flat buffer.

    ``start``: first element within the (flattened) parameter; ``length``: elements;
    ``offset``: where it begins inside the range (e.g. within this rank's shard).
    """

    index: int
    start: int
    length: int
    offset: int

    @property
    def stop(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class FlatLayout:
    """Parameter sizes laid end to end, padded so the buffer splits into ``world`` equal shards."""

    numels: tuple[int, ...]
    world: int
    offsets: tuple[int, ...] = field(init=False)
    numel: int = field(init=False)
    shard_numel: int = field(init=False)
    padded_numel: int = field(init=False)

    def __post_init__(self) -> None:
        offsets, pos = [], 0
        for n in self.numels:
            offsets.append(pos)
            pos += n
        shard = -(-pos // self.world)
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "numel", pos)
        object.__setattr__(self, "shard_numel", shard)
        object.__setattr__(self, "padded_numel", shard * self.world)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``(start, numel)`` of rank ``rank``'s shard in the flat buffer."""
        return rank * self.shard_numel, self.shard_numel

    def segments(self, start: int, numel: int) -> tuple[Segment, ...]:
        """The non-empty parameter pieces inside flat range ``[start, start + numel)``, in order.

        Padding past the last parameter belongs to no segment."""
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels, strict=True)):
            seg = self._clip(i, off, n, start, numel)
            if seg is not None:
                out.append(seg)
        return tuple(out)

    def segment_of(self, index: int, start: int, numel: int) -> Segment | None:
        """Parameter ``index``'s piece inside flat range ``[start, start + numel)`` (None if none)."""
        return self._clip(index, self.offsets[index], self.numels[index], start, numel)

    def shard_segments(self, rank: int) -> tuple[Segment, ...]:
        return self.segments(*self.shard_range(rank))

    @staticmethod
    def _clip(index: int, off: int, n: int, start: int, numel: int) -> Segment | None:
        a, b = max(off, start), min(off + n, start + numel)
        return Segment(index, a - off, b - a, a - start) if a < b else None
