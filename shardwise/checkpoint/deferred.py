"""A shard file's piece whose bytes are read only when the writer reaches it.

Why: with ``offload_optimizer.device: nvme`` the masters and optimizer states live in swap files; reading
them all into host memory before the save would hold the whole optimizer state on the host once. A
:class:`Deferred` piece carries what the safetensors header needs up front (dtype, shape) and a ``fetch``
that reads its bytes when the writer (``shard_writer.py``) or the asynchronous snapshot (``staging.py``)
gets to it, in file order: the swapper keeps one group read at a time (``nvme/resident.py``'s
``streamed``), so the save holds one group's state, not the whole of it. The bytes are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Deferred:
    """``dtype`` and ``shape`` of a host tensor that ``fetch()`` returns when called (once, in file order)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    fetch: Callable[[], torch.Tensor]

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # read into host memory

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()


def resolve(t: torch.Tensor | Deferred) -> torch.Tensor:
    """The tensor of a piece: ``t`` itself, or a deferred piece's bytes read now (checked for its plan)."""
    if not isinstance(t, Deferred):
        return t
    out = t.fetch()
    if out.dtype != t.dtype or tuple(out.shape) != t.shape:
        raise RuntimeError(f"a deferred checkpoint piece read as {out.dtype} {tuple(out.shape)}, "
                           f"planned {t.dtype} {t.shape}")
    return out
