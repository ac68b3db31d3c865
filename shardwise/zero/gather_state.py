"""Stage 3's half of :class:`~shardwise.zero.flat_group.ShardedGroup`: gather before use, release after.

Kept apart from the gradient and step half because it is one state machine: a group's full
parameters are RELEASED (only the store's shard persists), GATHERING (an all-gather or file read
fills the flat buffer) or GATHERED, and only :meth:`StageThreeGather._to_gathered` and
:meth:`StageThreeGather._to_released` change that (FSDP2's ``FSDPParamGroup`` model). hpZ's
secondary shard (ZeRO++) lives here too: it is what a backward gathers from inside a node.
"""

from __future__ import annotations

from enum import Enum

import torch

from shardwise.comm import Work
from shardwise.zero.gather_pool import PoolFull
from shardwise.zero.pending import ReadThenGather, ReadWork
from shardwise.zero.quantized_comm import quantized_all_gather


class GatherState(Enum):
    """Where a group's full parameters are (FSDP2's sharded/unsharded, with the in-flight step).

    RELEASED: only the store's shard; parameters are NaN placeholders (stage 3 between uses).
    GATHERING: an all-gather or file read into the flat buffer is in flight; ``wait_gathered()``.
    GATHERED: the flat buffer holds every parameter (always so at stages 0-2, once waited).
    """

    RELEASED = "released"
    GATHERING = "gathering"
    GATHERED = "gathered"


class StageThreeGather:
    """Mixed into ShardedGroup, whose constructor sets the attributes used here (``state``,
    ``store``, ``flat_param``, ``pool``, ``secondary``, ``weight_bits``, the layout)."""

    @property
    def is_gathered(self) -> bool:
        """The flat buffer is (or is being) filled: parameters are views of it."""
        return self.state is not GatherState.RELEASED

    def _to_gathered(self, work: Work | ReadWork | ReadThenGather | None) -> None:
        """GATHERING while ``work`` (the all-gather or read filling the buffer) runs, else GATHERED."""
        self._gather_work = work
        self.state = GatherState.GATHERED if work is None else GatherState.GATHERING

    def _to_released(self) -> None:
        self._gather_work = None
        self.state = GatherState.RELEASED

    def gather(self, async_op: bool = False, exact: bool = False) -> None:
        """Make the full parameters available (all-gather into the flat buffer).

        With ``weight_bits`` (qwZ) the gathered copy is dequantized, unless ``exact``
        (GatheredParameters: what users read or edit are the true weights).
        """
        if self.state is not GatherState.RELEASED:
            if not async_op:
                self.wait_gathered()
            return
        if self.pool is not None:
            if not self._take_pool_buffer(async_op):
                return  # a prefetch with every buffer taken: put off until a unit is released
        elif self.flat_param.numel() == 0:  # released with detach_storage: a buffer of its own
            self.flat_param = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
        else:
            self.flat_param.untyped_storage().resize_(self.padded_numel * self.flat_param.element_size())
        if self.secondary_shard is not None and not exact:  # hpZ: unchanged since the forward kept it
            self._gather_secondary(async_op)
            return
        owned = self.flat_param.narrow(0, self.own_start, self.own_numel)
        if self.weight_bits and not exact:  # qwZ: param_shard (and the master) stay exact, flat_param is dequantized
            work = quantized_all_gather(self.comm, self.param_shard, self.flat_param, self.weight_bits,
                                        async_op=async_op)
        else:  # one rank: a file read goes to the reader thread (gloo collectives are async already)
            ahead = async_op and (self.comm.size == 1 or getattr(self.store, "reads_ahead_of_gather", False))
            read = self.store.fill(self, owned, async_read=ahead)
            flat, comm = self.flat_param, self.comm
            work = (ReadThenGather(read, lambda: comm.all_gather(flat)) if read is not None and comm.size > 1
                    else read or comm.all_gather(flat, async_op=async_op))
        self._point_params_at_buffer(work, async_op)

    def _take_pool_buffer(self, async_op: bool) -> bool:
        """Point ``flat_param`` at a free pool buffer. A prefetch finding none is put off (False);
        a gather needed now waits for one: the fetcher releases a unit that was only read ahead."""
        buf = self.pool.acquire(self.dtype, self.padded_numel)
        if buf is None and async_op:
            self.pool.deferred += 1
            return False
        fetcher = getattr(self, "fetcher", None)
        if buf is None and fetcher is not None and fetcher.make_room(self):
            buf = self.pool.acquire(self.dtype, self.padded_numel)
        if buf is None:
            raise PoolFull(f"stage 3: the gather pool's {self.pool.slots} layer buffers all hold units that are "
                           "running; a layer's forward gathered more layers than the pool was made for "
                           "(raise prefetch, which sizes the pool)")
        self.flat_param = buf
        return True

    def _point_params_at_buffer(self, work: Work | ReadWork | ReadThenGather | None, async_op: bool) -> None:
        """The gather is under way: parameters become views of the (filling) flat buffer."""
        self._to_gathered(work)
        for p, off in zip(self.params, self.offsets, strict=True):
            p.data = self._view(self.flat_param, off, p)
        if not async_op:
            self.wait_gathered()

    def _secondary_range(self) -> tuple[int, int]:
        n = self.padded_numel // self.secondary.size
        return self.secondary.rank * n, n

    def _gather_secondary(self, async_op: bool) -> None:
        """hpZ: refill the flat buffer from the secondary shards of the k ranks of a node.

        The shards hold what the forward computed with (dequantized under qwZ), so the backward
        differentiates exactly the forward's weights.
        """
        start, n = self._secondary_range()
        with torch.no_grad():
            self.flat_param.narrow(0, start, n).copy_(self.secondary_shard)
        self._point_params_at_buffer(self.secondary.all_gather(self.flat_param, async_op=async_op), async_op)

    def drop_secondary(self) -> None:
        """The parameters changed (optimizer step, edit, load) or the backward is over."""
        self.secondary_shard = None

    def wait_gathered(self) -> None:
        """GATHERING -> GATHERED: the buffer holds the full parameters once this returns."""
        if self._gather_work is not None:
            self._gather_work.wait()
            self._to_gathered(None)

    def release(self, keep_secondary: bool = False, detach_storage: bool = False) -> None:
        """Free the full parameters; each param becomes a 1-element NaN placeholder of full shape.

        The placeholder keeps ``p.shape`` right for code that reads shapes, makes any compute
        with a released parameter loudly NaN (never a silent size-0 or zero tensor), and
        refuses writes. ``keep_secondary`` (after a training forward, hpZ) keeps this rank's
        1/k of the full parameters for the backward's gather inside the node.
        ``detach_storage`` (the end of a ``GatheredParameters`` block): instead of freeing the
        buffer's storage in place, the group lets go of it, so tensors the user kept from the
        block (``p.detach().cpu()`` is a view on CPU, ``state_dict()`` values are views) stay
        valid and the memory goes when they do; the next gather allocates a new buffer.
        """
        if not self.policy.shard_params or self.state is GatherState.RELEASED:
            return
        self.wait_gathered()
        if keep_secondary and self.secondary is not None and self.secondary_shard is None:
            start, n = self._secondary_range()
            self.secondary_shard = self.flat_param.narrow(0, start, n).clone()
        nan = torch.full((1,), float("nan"), dtype=self.dtype, device=self.device)
        for p in self.params:
            p.data = nan.expand(p.shape)
        if self.pool is not None:  # frozen: no saved view needs this storage again
            self.pool.give_back(self.flat_param)
            self.flat_param = torch.empty(0, dtype=self.dtype, device=self.device)
        elif detach_storage:
            self.flat_param = torch.empty(0, dtype=self.dtype, device=self.device)
        else:
            self.flat_param.untyped_storage().resize_(0)
        self._to_released()

