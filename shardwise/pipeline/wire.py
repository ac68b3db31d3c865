"""What crosses between two stages: a tensor or a tuple of tensors, described first, then sent.

Each transfer is a header (int64: the number of tensors, then per tensor its dtype code, rank and
shape), preceded by the header's length, then the tensors themselves; so stages may hand each other
any shapes, which may change from one micro-batch to the next. A stage output that is not a tensor
or a tuple/list of tensors is refused in one line naming the stage. A receive that fails (the peer
died, or stalled past the timeout) raises one line naming this stage, this rank, the peer and the
transfer; so does a send that fails (the peer's connection closed).
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise.comm import PointToPoint, RanksDivergedError, Work
from shardwise.engine.compat import UsageError

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]
_CODE = {d: i for i, d in enumerate(_DTYPES)}
MAX_TENSORS, MAX_DIMS = 64, 8


def _detail(e: BaseException) -> str:
    """What the backend said, on one line (the first cause: gloo's own words, not the guard's advice)."""
    cause = e.__cause__ if e.__cause__ is not None else e
    return f"{type(cause).__name__}: {' '.join(str(cause).split())[:240]}"


class StageTransferError(RuntimeError):
    """A transfer between pipeline stages failed: the peer died or stalled past the timeout."""


def as_tensors(value: Any, stage: int, what: str) -> tuple[torch.Tensor, ...]:
    """``value`` as a tuple of tensors, or one line saying why a stage cannot send it."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    bad = [type(v).__name__ for v in items if not isinstance(v, torch.Tensor)]
    if bad or not items or len(items) > MAX_TENSORS:
        raise UsageError(f"pipeline stage {stage}'s {what} must be a tensor or a tuple of at most "
                         f"{MAX_TENSORS} tensors; got {type(value).__name__}"
                         + (f" holding {', '.join(sorted(set(bad)))}" if bad else ""))
    for t in items:
        if t.dtype not in _CODE or t.dim() > MAX_DIMS:
            raise UsageError(f"pipeline stage {stage}'s {what}: a {t.dtype} tensor of {t.dim()} dims cannot be "
                             f"sent between stages (dtypes {[str(d) for d in _DTYPES]}, at most {MAX_DIMS} dims)")
    return tuple(items)


STOPPED = -1  # a header length that says: the sending stage stopped (its error is its own line)


class Link:
    """This stage's sends to and receives from its neighbours, over the pipeline's :class:`PointToPoint`."""

    def __init__(self, p2p: PointToPoint, stage: int, ranks: list[int], device: torch.device):
        """``device``: where headers live (the compute device: NCCL sends device tensors only)."""
        self.p2p, self.stage, self.ranks, self.device = p2p, stage, ranks, device
        self.pending: list[Work] = []
        self.stopping: list[Work] = []
        self.stopped_peer: int | None = None
        # interleaved schedules: a label leads each header, and a transfer that arrives before the one
        # awaited (the two directions of a pair of ranks share one ordered channel) waits here
        self.stash: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.ring = False  # the last stage sends on to the first (virtual stages): both are neighbours

    def send(self, tensors: tuple[torch.Tensor, ...], peer: int, label: int | None = None,
             what: str = "a transfer") -> None:
        header = ([] if label is None else [label]) + [len(tensors)]
        for t in tensors:
            header += [_CODE[t.dtype], t.dim(), *t.shape]
        head = torch.tensor(header, dtype=torch.int64, device=self.device)
        try:
            self.pending += [self.p2p.send(torch.tensor([len(header)], dtype=torch.int64, device=self.device), peer),
                             self.p2p.send(head, peer)]
            self.pending += [self.p2p.send(t.detach(), peer) for t in tensors]
        except RanksDivergedError as e:  # the peer is gone (its connection closed), or the group already failed
            raise StageTransferError(
                f"pipeline stage {self.stage} (rank {self.ranks[self.stage]}) failed sending {what} to stage {peer} "
                f"(rank {self.ranks[peer]}): that stage died, stalled past the timeout or stopped; restart the "
                f"job. ({_detail(e)})") from e

    def recv(self, peer: int, what: str, device: torch.device, label: int | None = None) -> tuple[torch.Tensor, ...]:
        """The next transfer from ``peer``; with a ``label``, the one sent with it (others are kept)."""
        if label is None:
            return self._recv(peer, what, device, False)[1]
        while (peer, label) not in self.stash:
            got, tensors = self._recv(peer, what, device, True)
            self.stash[(peer, got)] = tensors
        return self.stash.pop((peer, label))

    def _recv(self, peer: int, what: str, device: torch.device, labelled: bool) -> tuple[int, tuple]:
        try:
            n = torch.zeros(1, dtype=torch.int64, device=self.device)
            self.p2p.recv(n, peer)
            if int(n) == STOPPED:
                self.stopped_peer = peer  # told already: not told back
                raise StageTransferError(f"stage {peer} stopped with an error of its own (see rank "
                                         f"{self.ranks[peer]}'s line)")
            if not 0 < int(n) <= 2 + MAX_TENSORS * (2 + MAX_DIMS):
                raise StageTransferError(f"a header of {int(n)} numbers")
            head = torch.zeros(int(n), dtype=torch.int64, device=self.device)
            self.p2p.recv(head, peer)
            head = head.tolist()  # one host read of the header
            label = head.pop(0) if labelled else -1
            out, pos = [], 1
            for _ in range(int(head[0])):
                code, ndim = int(head[pos]), int(head[pos + 1])
                shape = head[pos + 2:pos + 2 + ndim]
                pos += 2 + ndim
                t = torch.empty(shape, dtype=_DTYPES[code], device=device)
                self.p2p.recv(t, peer)
                out.append(t)
            return label, tuple(out)
        except (RanksDivergedError, StageTransferError) as e:
            raise StageTransferError(
                f"pipeline stage {self.stage} (rank {self.ranks[self.stage]}) failed receiving {what} from stage "
                f"{peer} (rank {self.ranks[peer]}): that stage died, stalled past the timeout or sent something "
                f"else; restart the job. ({_detail(e)})") from e

    def stop(self) -> None:
        """Tell both neighbours this stage stopped, so that a stage waiting on it ends now with a line
        naming it instead of at the timeout (best effort: a neighbour that is gone is not told)."""
        last = len(self.ranks) - 1
        ring = {last if self.stage == 0 else None, 0 if self.stage == last else None} if self.ring else set()
        for peer in sorted({self.stage - 1, self.stage + 1} | (ring - {None})):
            if 0 <= peer < len(self.ranks) and peer != self.stopped_peer:
                try:  # kept, not waited for: the work must outlive this call for the bytes to leave
                    self.stopping.append(self.p2p.send(torch.tensor([STOPPED], dtype=torch.int64,
                                                                  device=self.device), peer))
                except RanksDivergedError:
                    pass  # that neighbour is gone; this stage's own error is raised by the caller

    def drain(self) -> None:
        """Wait for every send started (their tensors may be written again after this)."""
        try:
            for w in self.pending:
                w.wait()
        except RanksDivergedError as e:
            raise StageTransferError(f"pipeline stage {self.stage} (rank {self.ranks[self.stage]}) failed "
                                     f"sending to a neighbouring stage ({_detail(e)})") from e
        finally:
            self.pending.clear()
