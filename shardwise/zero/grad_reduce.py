"""A sharded group's gradients: accumulated into the flat buffer in backward, then reduced.

Split from ``flat_group.py`` (``ShardedGroup`` mixes it in, as it mixes in ``StageThreeGather``):
the reduction side of a group is a concept of its own. The last gradient hook of a group (or the
end of backward) reduces its flat gradient: a reduce-scatter at stages 1-3 (summed into the kept
shard at stages 2-3), an all-reduce at stage 0, bounded by the model-wide ``InflightLimit``; a
backward that accumulates without the sync toggle sets the reduced range aside first and adds it
back after the wait (``docs/architecture.md``, "Accumulating without the sync toggle").
"""

from __future__ import annotations

import torch

from shardwise.comm import Work
from shardwise.zero.quantized_comm import quantized_reduce_scatter


class GradReduction:
    """``ShardedGroup``'s gradient side; its state (``flat_grad``, ``grad_shard``, the pending work)
    is made by ``ShardedGroup._init_grads``."""

    @property
    def grads_are_views(self) -> bool:
        """Is each ``param.grad`` a view of the flat gradient? Only when both have one dtype: with a
        wider ``grad_dtype`` autograd's compute-dtype gradient is folded in and dropped."""
        return self.grad_dtype == self.dtype

    def _alloc_flat_grad(self) -> None:
        self.flat_grad = torch.zeros(self.padded_numel, dtype=self.grad_dtype, device=self.device)
        if self.grads_are_views:
            for p, off in zip(self.params, self.offsets, strict=True):
                p.grad = self._view(self.flat_grad, off, p)

    # -- backward ---------------------------------------------------------------------
    def begin_backward(self, reduce_now: bool) -> None:
        """Arm the group for one backward; ``reduce_now`` at an accumulation boundary."""
        self._ready = 0
        # stages 2-3 reduce-scatter every backward (the shard is what accumulates), unless
        # ``defer_reduce`` (a pipeline batch): then the full bucket accumulates until the boundary
        self._reduce_now = reduce_now or (self.policy.shard_grads and not self.defer_reduce)
        if self._holds_reduced and not self.policy.shard_grads:
            self._set_aside_reduced()

    def _set_aside_reduced(self) -> None:
        """A second backward before the step, the first one already reduced (stages 0-1, no sync
        toggle). Autograd would add this rank's new gradients onto the sum over ranks, and the next
        reduction would count that sum once per rank. So the reduced (owned) range moves aside, the
        buffer restarts from zero, and ``wait`` adds the two sums once the new one is reduced:
        ``carry + new``, the order in which stages 2-3 accumulate their shard."""
        self.wait()
        # (wait() has folded any earlier carry into the owned range: a third backward carries both)
        self._reduced_carry = self.flat_grad.narrow(0, self.own_start, self.own_numel).clone()
        self.flat_grad.zero_()
        self._holds_reduced = False

    def _fold_carry(self) -> None:
        """After this backward's reduction finished: owned range = carry + new sum."""
        if self._reduced_carry is not None and self._holds_reduced and not self._pending:
            self.flat_grad.narrow(0, self.own_start, self.own_numel).add_(self._reduced_carry)
            self._reduced_carry = None

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if self.flat_grad is None:  # stage >= 2: the bucket lives only during its backward
            self._take_bucket()
            self._filled = [False] * len(self.params)
        elif self.inflight is not None and self.policy.shard_params:
            # stage 3: a reduction whose exchange ended after this bucket's take (the other rank was
            # behind) finishes here, and its bucket is let go: no take is near to reuse it
            self.inflight.finish_completed(keep=False)
        i = self._index[id(p)]
        view = self._view(self.flat_grad, self.offsets[i], p)
        if p.grad is not view and p.grad.data_ptr() != view.data_ptr():
            # autograd stole a fresh tensor (grad was None): copy it into the bucket (the first
            # gradient of a fresh stage >= 2 bucket) or fold it in (into a wider grad_dtype: every
            # micro-batch, so the sum is never rounded to the compute dtype)
            if self.policy.shard_grads and not self._filled[i]:
                view.copy_(p.grad)
            else:
                view.add_(p.grad)
            p.grad = view if self.grads_are_views and not self.policy.shard_grads else None
        if self.policy.shard_grads:
            self._filled[i] = True
        self._ready += 1
        if self._ready == len(self.params) and self._reduce_now:
            self.reduce_grads()

    def end_backward(self) -> None:
        """Reduce what backward left pending (groups whose params were unused)."""
        if self._reduce_now and self._ready < len(self.params) and self.flat_grad is not None:
            self.reduce_grads()
        elif self._reduce_now and self.flat_grad is None and self.policy.shard_grads:
            self._ready = len(self.params)  # no param of this group got a gradient

    def reduce_grads(self) -> None:
        """Sum gradients over ranks: all-reduce (stage 0), or reduce-scatter to the shard; in ``grad_dtype``."""
        self._ready = len(self.params)
        assert self.flat_grad is not None
        if not self.policy.shard_optimizer:
            # summed in rank order like stages 1-3's reduce-scatter: the stage never changes a bit
            w = self.comm.all_reduce_in_rank_order(self.flat_grad, async_op=self.overlap_comm)
            self._holds_reduced = True
        elif not self.policy.shard_grads:
            owned = self.flat_grad.narrow(0, self.own_start, self.own_numel)
            w = self._reduce_scatter(self.flat_grad, owned)
            self._holds_reduced = True
        else:
            if self.shard_grad is None:
                self.shard_grad = torch.empty(self.shard_numel, dtype=self.grad_dtype, device=self.device)
            self._zero_unfilled()
            accumulate, self._shard_grad_empty = not self._shard_grad_empty, False
            w = self._reduce_scatter(self.flat_grad, self.shard_grad, accumulate=accumulate)

            # (a list: with accumulation and overlap a second backward reduces before the first is waited)
            self._buckets_in_flight.append(self._bucket_base)
            self.flat_grad = self._bucket_base = None  # the bucket lives only until its reduce-scatter is done
            if w is None:
                self._give_bucket()
            self.release()  # stage 3: backward of this group is over
            self.drop_secondary()
        if w is not None:
            self._pending.append(w)
            if self.inflight is not None:  # bound the buckets (and ring buffers) held by pending work
                if self.policy.shard_params:  # stage 3: make_room may finish it once its exchange is over
                    w.watch()
                self.inflight.admit(self)

    def _reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> Work | None:
        """The gradient reduce-scatter: exact, or block-quantized (qgZ) with ``grad_bits``."""
        if self.grad_bits:
            return quantized_reduce_scatter(self.comm, full, out, self.grad_bits, async_op=self.overlap_comm,
                                            accumulate=accumulate)
        return self.comm.reduce_scatter(full, out, async_op=self.overlap_comm, accumulate=accumulate)

    def _zero_unfilled(self) -> None:
        """A stage >= 2 bucket starts uninitialized: zero the padding and params without a grad."""
        self.flat_grad.narrow(0, self.numel, self.padded_numel - self.numel).zero_()
        for i, filled in enumerate(self._filled):
            if not filled:
                self.flat_grad.narrow(0, self.offsets[i], self.numels[i]).zero_()

    def reductions_completed(self) -> bool:
        """Is the communication of every pending reduction over (``wait()`` would only add and hand
        the bucket on)? Never blocks: an event query on NCCL, the watcher's mark on gloo."""
        return all(w.is_completed() for w in self._pending)

    def wait(self) -> None:
        for w in self._pending:
            w.wait()
        self._pending.clear()
        self._give_bucket()
        self._fold_carry()

    def _take_bucket(self) -> None:
        """Stage >= 2: this backward's bucket, a reused buffer when one is free (see InflightLimit)."""
        if self.inflight is None:
            self._bucket_base = torch.empty(self.padded_numel, dtype=self.grad_dtype, device=self.device)
        else:
            if self.policy.shard_params:  # stage 3: the filling bucket and limit - 1 reducing (make_room)
                self.inflight.make_room()
            self._bucket_base = self.inflight.take_bucket(self.padded_numel, self.grad_dtype, self.device)
        self.flat_grad = self._bucket_base.narrow(0, 0, self.padded_numel)

    def _give_bucket(self) -> None:
        """The reduce-scatters of the buckets in flight are done: hand their buffers on."""
        if self.inflight is not None:
            for bucket in self._buckets_in_flight:
                self.inflight.give_bucket(bucket)
        self._buckets_in_flight.clear()

    # -- step -------------------------------------------------------------------------
