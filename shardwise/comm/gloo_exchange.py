"""gloo's all-gather and reduce-scatter, as point-to-point exchanges of shard-sized chunks.

gloo's own all-gather and reduce-scatter are slower than its all-reduce of the same full buffer
(measured in ``comm/core.py``'s docstring), so on gloo :class:`~shardwise.comm.Comm` runs them here:
the reduce-scatter as a direct exchange whose chunks are added in rank order (one order for every
element, so the ZeRO stages agree to the bit), the all-gather as a ring. Both move the bytes of a
ring. The receive chunks are kept for reuse (a fresh one per call costs more in page faults than
the additions).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from shardwise.comm.work import Work


class GlooExchanges:
    """Mixed into :class:`~shardwise.comm.Comm`, which provides ``size``, ``rank``, ``group``,
    ``_free_buffers``, ``_guard``, ``_work`` and ``_global``."""

    # -- gloo: point-to-point exchanges ----------------------------------------------------
    def _rank_order_reduce(self, full: torch.Tensor, async_op: bool, finish,
                           out: torch.Tensor | None = None) -> Work | None:
        """Reduce-scatter of the N chunks of ``full``: chunk ``rank`` (or ``out``) becomes the sum over ranks.

        Every rank sends chunk j to rank j and receives its own chunk from every other rank (the
        bytes of a ring: (N-1)/N of ``full`` each way), then adds the N pieces in rank order,
        ((g0 + g1) + g2) + ... . So an element's sum has the same bits whichever chunk it lands in
        (a ring starts each chunk's sum at another rank), whatever the bucket boundaries and
        whether the result is then all-gathered (stage 0) or kept (stages 1-3). The price: N-1
        receive chunks instead of the ring's one (the same at 2 ranks). The exchange runs in the
        background; the additions happen in ``wait()``, the first one written into ``out`` when
        given (a stage >= 2 shard: no pass through the chunk and a copy after).
        """
        n, r = self.size, self.rank
        size = full.numel() // n
        mine = full.narrow(0, r * size, size)
        others = [j for j in range(n) if j != r]
        # ``out`` apart from ``full`` (a stage >= 2 shard) receives the first other rank's chunk itself:
        # the first sum is written over it (one of its own two terms, elementwise), so that chunk
        # needs no receive buffer (none at 2 ranks); the sums and their order are the same
        direct = out if out is not None and _apart(out, full) and _fits(out, full, size) else None
        staged = others[1:] if direct is not None else others
        buf = self._take_buffer(len(staged) * size, full.dtype, full.device) if staged else None
        recv = {j: buf.narrow(0, i * size, size) for i, j in enumerate(staged)}
        if direct is not None:
            recv[others[0]] = direct
        handles = []
        for j in others:  # every isend / irecv is posted at once: no ordering to deadlock on
            handles.append(self._guard("reduce_scatter", dist.isend, full.narrow(0, j * size, size),
                                       self._global(j), group=self.group))
            handles.append(self._guard("reduce_scatter", dist.irecv, recv[j], self._global(j), group=self.group))

        def add_in_rank_order() -> None:
            sum_in_rank_order([mine if j == r else recv[j] for j in range(n)], mine,
                               out if out is not None else mine)
            if buf is not None:
                self._give_buffer(buf)
            if finish is not None:
                finish()

        work = self._work(handles, "reduce_scatter", add_in_rank_order, p2p=True)
        if async_op:
            return work
        work.wait()
        return None

    # -- gloo: the ring all-gather ---------------------------------------------------------
    def _ring(self, full: torch.Tensor, async_op: bool) -> Work | None:
        """All-gather of the N chunks of ``full``, in place (the reduce-scatter is ``_rank_order_reduce``).

        Step k sends one chunk to the next rank and receives one from the previous, stored in
        place. All steps but the last run here; the last is returned pending when ``async_op``
        (with 2 ranks: the whole exchange).
        """
        n, r = self.size, self.rank
        size = full.numel() // n
        chunk = lambda i: full.narrow(0, (i % n) * size, size)  # noqa: E731
        nxt, prv = self._global((r + 1) % n), self._global((r - 1) % n)
        for k in range(n - 1):
            handles = [self._guard("all_gather", dist.isend, chunk(r - k), nxt, group=self.group),
                       self._guard("all_gather", dist.irecv, chunk(r - k - 1), prv, group=self.group)]
            work = self._work(handles, "all_gather", p2p=True)
            if k == n - 2 and async_op:
                return work
            work.wait()
        return None

    @property
    def free_buffer_nbytes(self) -> int:
        """Bytes of receive chunks kept for the next reduce-scatter (gloo; ``memory_report()["comm_buffers"]``)."""
        return sum(b.numel() * b.element_size() for bufs in self._free_buffers.values() for b in bufs)

    def _take_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Receive chunks for a reduce-scatter, reused from finished ones when one fits.

        A fresh chunk per call is a fresh mmap of tens of MiB whose page faults cost more than
        the additions (see docs/estimate.md, "Planner against measurement"). Pending rings
        (``overlap_comm``) each hold their own chunk until ``_give_buffer`` returns it.
        """
        free = self._free_buffers.setdefault((dtype, device), [])
        for i, buf in enumerate(free):
            if buf.numel() >= numel:
                return free.pop(i)
        return torch.empty(numel, dtype=dtype, device=device)

    def drop_free_buffers(self) -> None:
        """Let go of the kept receive chunks (stage 3 after each backward: none lives into a forward)."""
        self._free_buffers.clear()

    def _give_buffer(self, buf: torch.Tensor) -> None:
        free = self._free_buffers.setdefault((buf.dtype, buf.device), [])
        if len(free) < 4:  # bounded: at most a few rings are ever in flight
            free.append(buf)


def sum_in_rank_order(terms: list[torch.Tensor], mine: torch.Tensor, dest: torch.Tensor) -> None:
    """``dest = ((terms[0] + terms[1]) + terms[2]) + ...``; ``mine`` (one of the terms) may be ``dest``.

    (a + b is b + a bit for bit, so writing the first sum into ``mine`` is safe when ``mine`` is
    one of the first two terms; a later term must not be overwritten before it is read.)"""
    if dest.data_ptr() == mine.data_ptr() and all(t is not mine for t in terms[:2]):
        acc = terms[0]  # a receive chunk, free after this
        for t in terms[1:]:
            acc.add_(t)
        dest.copy_(acc)
        return
    torch.add(terms[0], terms[1], out=dest)
    for t in terms[2:]:
        dest.add_(t)


def _apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do ``a`` and ``b`` share no storage (so a receive into ``a`` cannot touch what ``b`` sends)?"""
    return a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


def _fits(out: torch.Tensor, full: torch.Tensor, size: int) -> bool:
    """Can ``out`` take a chunk of ``full`` as it is sent (its dtype, ``size`` contiguous elements)?"""
    return out.dtype == full.dtype and out.numel() == size and out.is_contiguous()
