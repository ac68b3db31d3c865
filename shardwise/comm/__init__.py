"""``shardwise.comm``: the library's collectives (:class:`Comm`, counted) and ``deepspeed.comm``'s functions.

- ``core``: process groups, :class:`Comm` (every collective the library issues), byte accounting,
  the teardown and the diverged-ranks guard; ``gloo_exchange``: gloo's all-gather and reduce-scatter
  as point-to-point exchanges (mixed into :class:`Comm`); ``work``: :class:`Work`, a collective in
  flight, and its non-blocking ``is_completed()`` (a watcher thread for gloo's sends and receives);
  ``p2p``: :class:`PointToPoint`, the pipeline stages' sends and receives (counted as ``send`` / ``recv``).
- ``compat``: DeepSpeed's ``deepspeed.comm`` names (``get_rank``, ``all_reduce``, ``barrier``, ...);
  its ``init_distributed`` (DeepSpeed's signature) is the one this package exports.
"""

from __future__ import annotations

from shardwise.comm.compat import *  # noqa: F403 (deepspeed.comm's names, listed in compat.__all__)
from shardwise.comm.compat import __all__ as _compat_names
from shardwise.comm.core import (
    Comm,
    CommStats,
    RanksDivergedError,
    Work,
    collective_timeout,
    compute_device,
    make_comm,
)
from shardwise.comm.p2p import PointToPoint, make_point_to_point

__all__ = ["Comm", "CommStats", "PointToPoint", "make_point_to_point",
           "RanksDivergedError", "Work", "collective_timeout", "compute_device", "make_comm",
           *_compat_names]
