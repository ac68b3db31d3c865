"""The collectives of :class:`shardwise.comm.Comm` beyond ZeRO's: all-to-all with split sizes (expert
dispatch, ring attention's passes) and Python objects (a rank's error or path, ranks' reports).

They live apart from ``core`` only to keep that file short; :class:`Comm` inherits them, so they
take the same guard (a failed or timed-out collective is one :class:`RanksDivergedError` naming the
collective and the rank, and the group is marked unusable) and count into the same
:class:`CommStats`. Objects are pickled here and moved as byte tensors through Comm's own guarded
``broadcast`` and ``all_gather`` (what ``torch.distributed``'s object collectives do inside), so
their bytes are counted, under ``broadcast`` and ``all_gather``, as every rank sees them.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from shardwise.comm.log import logged


class MoreCollectives:
    """Mixed into :class:`Comm`, which provides ``size``, ``rank``, ``group``, ``backend``, ``scope``,
    ``stats``, ``_guard``, ``_work``, ``broadcast`` and ``all_gather``."""

    @logged("all_to_all", tensor_arg=1)
    def all_to_all_v(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                     kind: str = "all_to_all", async_op: bool = False):
        """Rows ``in_splits[j]`` of ``inp`` (along dim 0) go to rank j, ``out_splits[j]`` rows of ``out``
        come from rank j. Counted under ``kind`` as the bytes of ``inp`` (what this rank sends).

        A group of one copies ``inp`` into ``out`` (its one split)."""
        if self.size == 1:
            out.copy_(inp)
            return self._work(None, kind) if async_op else None
        self.stats.add(kind + self.scope, inp.numel() * inp.element_size())
        h = self._guard(kind, dist.all_to_all_single, out, inp.contiguous(), output_split_sizes=out_splits,
                        input_split_sizes=in_splits, group=self.group, async_op=async_op)
        return self._work(h, kind) if async_op else None

    def _object_device(self) -> torch.device:
        """Where the byte tensors travel: NCCL moves only device tensors."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def broadcast_object_list(self, objects: list[Any], src: int = 0) -> None:
        """Every entry of ``objects`` replaced, in place, by group-rank ``src``'s (picklable objects)."""
        if self.size == 1:
            return
        dev = self._object_device()
        payload = pickle.dumps(list(objects)) if self.rank == src else b""
        length = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
        self.broadcast(length, src=src)
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=dev)
        if self.rank == src:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.broadcast(data, src=src)
        if self.rank != src:
            objects[:] = pickle.loads(data.cpu().numpy().tobytes())  # noqa: S301 - a peer rank of this job

    def all_gather_object(self, out: list[Any], obj: Any) -> None:
        """``out[j]`` = group-rank j's ``obj`` (``out`` has one entry per rank of the group)."""
        if self.size == 1:
            out[0] = obj
            return
        dev = self._object_device()
        payload = pickle.dumps(obj)
        lengths = torch.zeros(self.size, dtype=torch.int64, device=dev)
        lengths[self.rank] = len(payload)
        self.all_gather(lengths)
        width = int(lengths.max().item())
        data = torch.zeros(self.size * width, dtype=torch.uint8, device=dev)
        if payload:
            data.narrow(0, self.rank * width, len(payload)).copy_(torch.frombuffer(bytearray(payload),
                                                                                 dtype=torch.uint8))
        self.all_gather(data)
        raw = data.cpu().numpy().tobytes()
        for j, n in enumerate(lengths.tolist()):
            out[j] = pickle.loads(raw[j * width:j * width + n])  # noqa: S301 - a peer rank of this job
