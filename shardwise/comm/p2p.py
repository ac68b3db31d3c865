"""Point-to-point sends and receives between pipeline stages, guarded and counted like every collective.

Pipeline parallelism (``shardwise/pipeline/``) moves activations forward and their gradients back
between neighbouring stages. Those transfers go through :class:`PointToPoint` so that a peer that
died or stalled ends this rank with the diverged-ranks line within the job's timeout (not a backend
traceback after torch's 30 minutes), and so that their bytes show in ``comm_stats()`` under ``send``
and ``recv``.

Sends are asynchronous (``isend``): two neighbouring stages may each be sending to the other at once
(an activation forward, a gradient back), which blocking sends would deadlock on. Receives block;
the caller names what it waited for when one fails (``pipeline/wire.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.comm.core import Comm
from shardwise.comm.work import Work


class PointToPoint(Comm):
    """A :class:`Comm` over one pipeline's ranks (stage ``i`` is group rank ``i``) that also sends and
    receives single tensors."""

    def send(self, t: torch.Tensor, peer: int) -> Work:
        """Start sending ``t`` to group rank ``peer``; the returned work must be waited for before
        ``t`` is written again."""
        self.stats.add("send" + self.scope, t.numel() * t.element_size())
        h = self._guard("send", dist.isend, t.contiguous(), self._global(peer), group=self.group)
        return Work(h, self, "send", p2p=True)

    def recv(self, t: torch.Tensor, peer: int) -> None:
        """Fill ``t`` from group rank ``peer`` (blocking; the group's timeout bounds the wait)."""
        self.stats.add("recv" + self.scope, t.numel() * t.element_size())
        h = self._guard("recv", dist.irecv, t, self._global(peer), group=self.group)
        self._guard("recv", h.wait)


def make_point_to_point(group, stats) -> PointToPoint:
    """The point-to-point comm over ``group`` (a process group of one pipeline's stages), counted into ``stats``."""
    return PointToPoint(group, stats)
