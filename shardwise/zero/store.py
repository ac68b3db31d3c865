"""Where the persistent copy of a stage-3 shard lives, and how ``gather()`` gets it back.

A stage-3 group keeps only this rank's shard between uses; ``gather()`` puts it into the owned
range of the flat buffer and all-gathers the rest. The storage modes differ only in those two
steps, so each is one small class and :class:`~shardwise.zero.flat_group.ShardedGroup` holds one
of them instead of a flag per mode:

* :class:`ResidentStore`: the shard is a tensor on the compute device (plain stage 3) or in
  (optionally pinned) CPU memory (``offload_param``, ZeRO-Inference ``offload="cpu"``); a gather
  copies it in.
* :class:`MasterStore`: the trainable group's fp32 master on the compute device is the copy (no
  16-bit shard beside it); a gather casts it in.
* :class:`FileStore`: nothing is resident; every gather reads the shard again through a reader
  (ZeRO-Inference ``offload="disk"``, and quantized stores that dequantize into the buffer). Read
  on the reader thread when a single rank prefetches, so the read overlaps compute.

Either store may also carry ``reader``, the initial values' source (zero.Init from a checkpoint,
streamed inference): the shard is then read straight from it and the full group is never built.
The builder (``zero/builder.py``, ``build_groups``) chooses the store.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardwise.comm import compute_device
from shardwise.zero.host_copy import CopyAhead, copy_ahead, fence
from shardwise.zero.layout import Segment
from shardwise.zero.pending import ReadWork, read_pool

# reader(p, start, end) -> elements [start, end) of p flattened; with ``fills_out = True`` it is
# called as reader(p, start, end, out) and writes into ``out`` itself (no temporary per parameter)
Reader = Callable[..., torch.Tensor]


@torch.no_grad()
def read_segments(reader: Reader, params: Sequence[torch.Tensor], segments: Sequence[Segment],
                  dest: torch.Tensor, used: int) -> None:
    """Fill ``dest`` (a range of a flat buffer) with ``segments`` read through ``reader``.

    Only ``dest[used:]`` (the padding) is zeroed: the rest is overwritten by the reads, in the
    order given (see :func:`in_file_order`).
    """
    dest[used:].zero_()
    fills_out = getattr(reader, "fills_out", False)
    for seg in segments:
        out = dest[seg.offset:seg.offset + seg.length]
        if fills_out:
            reader(params[seg.index], seg.start, seg.stop, out)
        else:
            out.copy_(reader(params[seg.index], seg.start, seg.stop))


def in_file_order(reader: Reader, params: Sequence[torch.Tensor], segments: Sequence[Segment]) -> list[Segment]:
    """``segments`` sorted by where the reader finds them, for a reader with a ``position(param,
    start)`` (one reading files); else as given. safetensors stores tensors sorted by name, so a
    layer read in the model's order jumps back and forth and defeats the kernel's readahead (cold
    int4 layers: 116-155 ms in model order, 39-66 ms in file order, for the same 128 reads of
    54.6 MB: ``benchmarks/inference/bench_stream_reads.py``). The segments fill disjoint ranges, so the
    order changes nothing else."""
    position = getattr(reader, "position", None)
    if position is None:
        return list(segments)
    return sorted(segments, key=lambda seg: position(params[seg.index], seg.start))


class ShardStore:
    """The persistent copy of one group's shard. Subclasses say where it lives."""

    rereads = False  # True: the files are the copy (no tensor kept; a gather reads them again)

    def __init__(self, reader: Reader | None = None):
        self.reader = reader  # the initial values' source (None: the parameters' own values)
        self.shard: torch.Tensor | None = None
        self._order_of: Sequence[Segment] | None = None  # the segments _ordered was sorted from
        self._ordered: list[Segment] = []

    def keep(self, group: Any, owned: torch.Tensor | None) -> None:
        """At build: take this rank's shard, from ``reader`` or from ``owned`` (the filled buffer)."""
        raise NotImplementedError

    def fill(self, group: Any, owned: torch.Tensor, async_read: bool) -> ReadWork | None:
        """At gather: write the shard into ``owned``; a ReadWork when it goes on the reader thread."""
        raise NotImplementedError

    def update(self, src: torch.Tensor, non_blocking: bool = False) -> None:
        """The parameters changed (optimizer step, edit, load): ``src`` is the new shard."""
        if self.shard is not None:
            if self.shard.device.type == "cpu" and src.device.type == "cpu":  # a host write: no gather's
                fence(compute_device(), copies_too=True)  # no gather's copy out of this (pinned) shard pending
            self.shard.copy_(src, non_blocking=non_blocking)

    def update_range(self, src: torch.Tensor, start: int, non_blocking: bool = False) -> None:
        """Elements ``[start, start + n)`` of the shard become ``src`` (NVMe sub-groups); a store with
        no resident shard has no range to write (``nvme/`` steps its groups whole)."""
        if self.shard is None:
            raise ValueError(f"{type(self).__name__}: no resident shard to update a range of")
        if self.shard.device.type == "cpu" and src.device.type == "cpu":
            fence(compute_device(), copies_too=True)  # as update(): no gather's copy out of this shard pending
        self.shard.narrow(0, start, src.numel()).copy_(src, non_blocking=non_blocking)

    @property
    def nbytes(self) -> int:
        return 0 if self.shard is None else self.shard.numel() * self.shard.element_size()

    def _read(self, group: Any, dest: torch.Tensor) -> None:
        if self._order_of is not group.owned:  # sorted once per group, not per gather
            self._order_of, self._ordered = group.owned, in_file_order(self.reader, group.params, group.owned)
        read_segments(self.reader, group.params, self._ordered, dest, max(group.numel - group.own_start, 0))


class ResidentStore(ShardStore):
    """The shard is a tensor: on the compute device, or on ``device`` (CPU offload), pinned if asked."""

    def __init__(self, device: torch.device | None = None, pin_memory: bool = False, reader: Reader | None = None):
        super().__init__(reader)
        self.device, self.pin_memory = device, pin_memory

    def keep(self, group: Any, owned: torch.Tensor | None) -> None:
        pin = self.pin_memory and self.device is not None and torch.cuda.is_available()
        self.shard = torch.empty(group.own_numel, dtype=group.dtype, device=self.device or group.device,
                                 pin_memory=pin)
        if self.reader is not None:
            self._read(group, self.shard)
        else:
            self.shard.copy_(owned)

    def fill(self, group: Any, owned: torch.Tensor, async_read: bool) -> CopyAhead | None:  # noqa: ARG002
        with torch.no_grad():  # from pinned memory: the host moves on (zero/host_copy.py)
            if async_read:  # a prefetch (one rank): on the copy stream, overlapping the running layer
                return copy_ahead(owned, self.shard)
            owned.copy_(self.shard, non_blocking=True)  # needed now: on the compute stream
            return None


class FileStore(ShardStore):
    """No resident copy: every gather reads the shard through ``reader`` (offload="disk", quantized)."""

    rereads = True

    def __init__(self, reader: Reader):
        super().__init__(reader)

    def keep(self, group: Any, owned: torch.Tensor | None) -> None:
        """Nothing to keep: the files are the copy."""

    def fill(self, group: Any, owned: torch.Tensor, async_read: bool) -> ReadWork | None:
        if async_read:  # a file read needs a thread to overlap compute
            return ReadWork(read_pool().submit(self._read, group, owned))
        self._read(group, owned)
        return None


class MasterStore(ShardStore):
    """Stage 3 with an fp32 master on the compute device: the master *is* the persistent copy.

    A 16-bit shard beside the master would only ever hold ``master`` rounded to the compute dtype
    (every step writes it from the master, ``publish_master``), so a gather casts the master into
    the flat buffer's owned range instead, as FSDP2 casts its fp32 shard into its all-gather input:
    the same rounding, bit for bit, and 2 bytes x the shard less between uses (the master's 4 and
    the optimizer's state remain). ``shard`` is the master itself (fp32): what readers of the
    persistent copy get (a gather's source, DeepSpeed's ``ds_tensor`` piece, a comparison
    after ``GatheredParameters``); writes into it are writes into the master.

    Not with ``offload_param`` or ``offload_optimizer``: the master then lives on the host, and a gather
    from it would cross the bus every time (and the host would write a pinned copy a gather may
    still be reading); those keep a :class:`ResidentStore` (``ShardedGroup._init_master``)."""

    def __init__(self, master: torch.Tensor):
        super().__init__(None)
        self.shard = master

    def keep(self, group: Any, owned: torch.Tensor | None) -> None:
        """Nothing to keep: the master was made from the shard (``ShardedGroup._init_master``)."""

    def fill(self, group: Any, owned: torch.Tensor, async_read: bool) -> None:  # noqa: ARG002
        with torch.no_grad():  # same device: on the compute stream, rounded as a 16-bit copy would be
            owned.copy_(self.shard)

    def update(self, src: torch.Tensor, non_blocking: bool = False) -> None:
        """A new value for the parameters (an edit, a load): it goes into the master. Writing the
        master itself (``publish_master`` after a step) has nothing left to do."""
        if src is not self.shard:
            self.shard.copy_(src, non_blocking=non_blocking)

    @property
    def nbytes(self) -> int:
        """0: the master's bytes are counted once, as the master (``memory_report()["master_params"]``)."""
        return 0


def store_factory(mode: str = "device", reader: Reader | None = None,
                  pin_memory: bool = False) -> Callable[[], ShardStore]:
    """What the builder hands ``build_groups``: a new store per group.

    ``mode``: "device" (resident), "cpu" (offloaded, ``pin_memory``) or "file" (read at every
    gather through ``reader``)."""
    if mode == "file":
        if reader is None:
            raise ValueError("a file-backed store needs a reader")
        return lambda: FileStore(reader)
    if mode not in ("device", "cpu"):
        raise ValueError(f"store mode must be 'device', 'cpu' or 'file', got {mode!r}")
    device = torch.device("cpu") if mode == "cpu" else None
    return lambda: ResidentStore(device, pin_memory, reader)
