"""``SequenceParallel``: the SP group, and the rule that says when attention exchanges heads.

The rule: Ulysses attention runs whenever gradients are enabled, whatever the module's
train/eval flag, and under ``no_grad`` only inside ``sp.enabled()``. Why: batches split by the
data adapter must never reach a local attention (every rank would attend only to its own shard,
silently: DeepSpeed's ``disable_in_eval`` default does exactly that to a model left in eval mode,
as ``from_pretrained`` returns it), while ``generate()`` and evaluation on whole sequences run
under ``no_grad`` and need the model's own attention. ``sp.disabled()`` forces local attention
(a forward with gradients on whole sequences).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from shardwise.comm import Comm
from shardwise.layout import SequenceMesh, get_sequence_mesh


class SequenceParallel:
    """One SP group: ``size`` ranks holding consecutive shards of the same sequences."""

    def __init__(self, mesh: SequenceMesh):
        self.mesh = mesh
        self.comm: Comm = mesh.sp
        self._forced: bool | None = None  # None: follow torch.is_grad_enabled()
        # set by register_attention: "ulysses" or "ring", and the shard layout split_batch must use
        self.attention = "ulysses"
        self.layout = "contiguous"

    @classmethod
    def of_size(cls, sp_size: int, tp_size: int = 1) -> SequenceParallel:
        """Groups of ``sp_size`` ranks ``tp_size`` apart: consecutive without tensor parallelism, the
        ranks with the same TP rank with it (shardwise/layout/grid.py; collective: every rank calls it)."""
        return cls(get_sequence_mesh(sp_size, tp_size=tp_size))

    @property
    def tp_size(self) -> int:
        """The TP degree the groups were cut for: each rank's attention holds heads / tp_size heads."""
        return self.mesh.tp_size

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def group(self):  # noqa: ANN201
        """The torch process group (None: the world, or a group of one)."""
        return self.comm.group

    @property
    def data_world(self) -> int:
        """How many data-parallel replicas the world holds (world / SP degree)."""
        return self.mesh.data.size

    @property
    def data_rank(self) -> int:
        return self.mesh.data.rank

    def active(self) -> bool:
        """Whether attention exchanges heads now (the rule in the module docstring)."""
        if self.size == 1:
            return False
        return torch.is_grad_enabled() if self._forced is None else self._forced

    @contextlib.contextmanager
    def _force(self, on: bool) -> Iterator[None]:
        before, self._forced = self._forced, on
        try:
            yield
        finally:
            self._forced = before

    def enabled(self) -> contextlib.AbstractContextManager[None]:
        """Exchange heads even under ``no_grad`` (evaluating sequence-split batches)."""
        return self._force(True)

    def disabled(self) -> contextlib.AbstractContextManager[None]:
        """Local attention even with gradients (a forward on whole, unsplit sequences)."""
        return self._force(False)


_CURRENT: list[SequenceParallel] = []  # the group the last registered attention uses


def set_current(sp: SequenceParallel) -> None:
    """Record ``sp`` as the process's SP group (what DeepSpeed's ``groups._get_sequence_parallel_*`` answer)."""
    _CURRENT[:] = [sp]


def current() -> SequenceParallel:
    """The process's SP group; a one-line error when no model was set up for sequence parallelism."""
    if not _CURRENT:
        raise RuntimeError("no sequence-parallel group: set sequence_parallel_size > 1 in the config, or call "
                           "shardwise.sequence_parallel.setup_sequence_parallel(model, n) first")
    return _CURRENT[0]
