"""The one sharding mechanism: a group of parameters flattened into one buffer.

Every ZeRO stage is a policy of :class:`ShardedGroup` (see ``docs/architecture.md``):

* the group's parameters are views into one flat, padded buffer ``flat_param``
  whose ``torch.chunk(world)`` piece ``rank`` is this rank's shard;
* stage >= 1: the optimizer steps only on this rank's shard (the fp32 "master");
  the updated shards are all-gathered back into ``flat_param``;
* stage >= 2: gradients are reduce-scattered as soon as the group's backward is
  done, and only the shard is kept;
* stage 3: only the shard (``param_shard``) persists; ``gather()`` refills the
  flat buffer just before the group's module runs and ``release()`` frees it
  after (the buffer's storage is resized, so views that autograd saved during
  forward see the refilled data in backward).

Stage 0 is the same group with the whole buffer "owned" by every rank (an
all-reduce instead of a reduce-scatter, no all-gather): DDP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.comm import Comm, Work
from shardwise.zero.gather_pool import GatherPool
from shardwise.zero.layout import FlatLayout
from shardwise.zero.pending import InflightLimit, ReadWork, read_pool
from shardwise.zero.quantized_comm import quantized_all_gather, quantized_reduce_scatter


def owner_of(p: torch.Tensor) -> ShardedGroup | None:
    """The group holding parameter ``p`` (None if it is not sharded by shardwise)."""
    return getattr(p, "_shardwise_group", None)


@dataclass(frozen=True)
class ShardPolicy:
    """What a ZeRO stage shards."""

    shard_optimizer: bool
    shard_grads: bool
    shard_params: bool

    @classmethod
    def for_stage(cls, stage: int) -> ShardPolicy:
        return cls(shard_optimizer=stage >= 1, shard_grads=stage >= 2, shard_params=stage >= 3)


class ShardedGroup:
    """Parameters of one bucket (or one module) sharing a flat buffer and its shards.

    ``master`` is what the optimizer steps on: a view of this rank's shard of
    ``flat_param`` when the parameters are fp32 and stay on their device (no
    second copy, so fp32 training holds K = 8 bytes of optimizer state and no
    master), otherwise a separate fp32 tensor, on the CPU with optimizer offload.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        names: list[str],
        comm: Comm,
        policy: ShardPolicy,
        master_dtype: torch.dtype = torch.float32,
        offload_device: torch.device | None = None,
        pin_memory: bool = False,
        overlap_comm: bool = False,
        param_offload_device: torch.device | None = None,
        trainable: bool = True,
        shard_reader: Callable[[nn.Parameter, int, int], torch.Tensor] | None = None,
        device: torch.device | None = None,
        reread_shard: bool = False,
        inflight: InflightLimit | None = None,
        replicate: Comm | None = None,
        secondary: Comm | None = None,
        weight_bits: int = 0,
        grad_bits: int = 0,
        pool: GatherPool | None = None,
    ):
        if len({p.dtype for p in params}) != 1:
            raise ValueError(f"one group holds one dtype; got {sorted({str(p.dtype) for p in params})}")
        self.params, self.names, self.comm, self.policy = params, names, comm, policy
        # Hybrid sharding: ranks holding the same shard in other shard groups; their gradient
        # shards are summed once per step (see attach_master_grad).
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        # ZeRO++ hpZ (stage 3): after a training forward this rank keeps its 1/k of the full parameters,
        # so the backward gathers inside the k ranks of ``secondary`` (a node) instead of over every rank.
        self.secondary = secondary if secondary is not None and secondary.size > 1 and policy.shard_params else None
        self.secondary_shard: torch.Tensor | None = None  # valid until the parameters change
        self.overlap_comm = overlap_comm
        self.inflight = inflight
        # ZeRO++ (zero/quantized_comm.py): bits of the stage-3 parameter all-gather (qwZ) and of the
        # gradient reduce-scatter (qgZ); 0 = exact. Nothing is quantized on a group of one rank.
        self.weight_bits = weight_bits if comm.size > 1 and policy.shard_params and not reread_shard else 0
        self.grad_bits = grad_bits if comm.size > 1 and policy.shard_optimizer else 0
        self._filled: list[bool] = []
        self.trainable = trainable
        self.dtype = params[0].dtype
        self.tp_sharded = False  # a TP slice? set by the builder (zero/partition.py): ZeRO reads no TP specs
        self.device = device if device is not None else params[0].device
        self.layout = FlatLayout(tuple(p.numel() for p in params), comm.size)
        if policy.shard_optimizer:
            self.own_start, self.own_numel = self.layout.shard_range(comm.rank)
        else:
            self.own_start, self.own_numel = 0, self.layout.padded_numel
        self.owned = self.layout.segments(self.own_start, self.own_numel)  # param pieces this rank owns

        # Read straight into the shard (zero.Init from a checkpoint): the full group is never built.
        from_files = shard_reader is not None and policy.shard_params
        self.pool = pool if policy.shard_params and not trainable else None
        if from_files and self.pool is not None:
            self.flat_param = torch.empty(0, dtype=self.dtype, device=self.device)
        elif from_files:
            self.flat_param = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
        else:
            self.flat_param = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
            with torch.no_grad():
                for p, off, n in zip(params, self.offsets, self.numels, strict=True):
                    src = shard_reader(p, 0, n) if shard_reader is not None else p.detach().reshape(-1)
                    self.flat_param[off : off + n].copy_(src)
            comm.broadcast(self.flat_param, src=0)  # every rank starts from rank 0's weights
            if self.replicate is not None:
                self.replicate.broadcast(self.flat_param, src=0)
        for p, off in zip(params, self.offsets, strict=True):
            if not from_files:
                p.data = self._view(self.flat_param, off, p)
            p._shardwise_group = self

        # (a pooled group has no buffer until its first gather; it is frozen, so needs no master)
        owned = self.flat_param
        if owned.numel():
            owned = owned.narrow(0, self.own_start, self.own_numel)
        # Stage 3: the persistent copy of the parameters is only this shard (on the CPU with
        # parameter offload); the flat buffer is refilled from it by gather().
        self.param_shard: torch.Tensor | None = None
        self._gathered = True
        self._gather_work: Work | ReadWork | None = None
        # ZeRO-Inference offload="disk": the files are the persistent copy, nothing stays resident
        # and every gather() reads the shard again through shard_reader.
        self._reread = shard_reader if reread_shard else None
        if reread_shard and not (from_files and not trainable):
            raise ValueError("reread_shard needs shard_reader, stage-3 policy and trainable=False")
        if self._reread is not None:
            self.release()
        elif policy.shard_params:
            self.param_shard = torch.empty(self.own_numel, dtype=self.dtype,
                                           device=param_offload_device or self.device,
                                           pin_memory=pin_memory and torch.cuda.is_available()
                                           and param_offload_device is not None)
            if from_files:
                self._read_shard(shard_reader, self.param_shard)
            else:
                self.param_shard.copy_(owned)
            owned = self.param_shard
            self.release()
        same_device = owned.device == (offload_device or owned.device)
        self.master_is_view = master_dtype == self.dtype and offload_device is None and same_device
        if not trainable:
            self.master = None
        elif self.master_is_view:
            self.master = owned
        else:
            dev = offload_device if offload_device is not None else self.device
            self.master = torch.empty(self.own_numel, dtype=master_dtype, device=dev,
                                      pin_memory=pin_memory and torch.cuda.is_available())
            self.master.copy_(owned)

        # Gradients. Without grad sharding the flat grad buffer is persistent and
        # every param.grad is a view of it (gradients accumulate in place).
        self.flat_grad: torch.Tensor | None = None
        self.shard_grad: torch.Tensor | None = None  # stage >= 2: reduced shard, accumulated
        if trainable and not policy.shard_grads:
            self._alloc_flat_grad()  # stage >= 2: shard_grad is made by the first reduction
        self._index = {id(p): i for i, p in enumerate(params)}
        self._ready = 0
        self._reduce_now = False
        self._pending: list[Work] = []
        self._bucket_in_flight: torch.Tensor | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for p in params] if trainable else []

    # -- layout (zero/layout.py owns the arithmetic) -------------------------------------
    @property
    def numels(self) -> tuple[int, ...]:
        return self.layout.numels

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.layout.offsets

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    @property
    def padded_numel(self) -> int:
        return self.layout.padded_numel

    @staticmethod
    def _view(flat: torch.Tensor, off: int, p: torch.Tensor) -> torch.Tensor:
        return flat.narrow(0, off, p.numel()).view(p.shape)

    # -- stage 3: gather before use, release after ---------------------------------------
    @property
    def is_gathered(self) -> bool:
        return self._gathered

    def gather(self, async_op: bool = False, exact: bool = False) -> None:
        """Make the full parameters available (all-gather into the flat buffer).

        With ``weight_bits`` (qwZ) the gathered copy is dequantized, unless ``exact``
        (GatheredParameters: what users read or edit are the true weights).
        """
        if self._gathered:
            if not async_op:
                self.wait_gathered()
            return
        if self.pool is not None:
            self.flat_param = self.pool.acquire(self.dtype, self.padded_numel, self.device)
        else:
            self.flat_param.untyped_storage().resize_(self.padded_numel * self.flat_param.element_size())
        if self.secondary_shard is not None and not exact:  # hpZ: unchanged since the forward kept it
            self._gather_secondary(async_op)
            return
        owned = self.flat_param.narrow(0, self.own_start, self.own_numel)
        if self._reread is not None and async_op and self.comm.size == 1:
            # a file read needs a thread to overlap compute (gloo collectives are async already)
            self._gather_work = ReadWork(read_pool().submit(self._read_shard, self._reread, owned))
        elif self.weight_bits and not exact:  # qwZ: param_shard (and the master) stay exact, flat_param is dequantized
            self._gather_work = quantized_all_gather(self.comm, self.param_shard, self.flat_param,
                                                     self.weight_bits, async_op=async_op)
        else:
            if self._reread is not None:
                self._read_shard(self._reread, owned)
            else:
                with torch.no_grad():
                    owned.copy_(self.param_shard)
            self._gather_work = self.comm.all_gather(self.flat_param, async_op=async_op)
        self._point_params_at_buffer(async_op)

    def _point_params_at_buffer(self, async_op: bool) -> None:
        """The gather is under way: parameters become views of the (filling) flat buffer."""
        self._gathered = True
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
        self._gather_work = self.secondary.all_gather(self.flat_param, async_op=async_op)
        self._point_params_at_buffer(async_op)

    def drop_secondary(self) -> None:
        """The parameters changed (optimizer step, edit, load) or the backward is over."""
        self.secondary_shard = None

    def wait_gathered(self) -> None:
        if self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work = None

    def release(self, keep_secondary: bool = False) -> None:
        """Free the full parameters; each param becomes a 1-element NaN placeholder of full shape.

        The placeholder keeps ``p.shape`` right for code that reads shapes, makes any compute
        with a released parameter loudly NaN (never a silent size-0 or zero tensor), and
        refuses writes. ``keep_secondary`` (after a training forward, hpZ) keeps this rank's
        1/k of the full parameters for the backward's gather inside the node.
        """
        if not self.policy.shard_params or not self._gathered:
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
        else:
            self.flat_param.untyped_storage().resize_(0)
        self._gathered = False

    @torch.no_grad()
    def _read_shard(self, reader: Callable[[nn.Parameter, int, int], torch.Tensor], dest: torch.Tensor) -> None:
        """Fill ``dest`` (this rank's shard) from ``reader``; only the padding is zeroed.

        A reader with ``fills_out = True`` is called as ``reader(p, start, end, out)`` and writes
        into ``out`` itself (no temporary per parameter: offload="disk" reads at every gather).
        """
        dest[max(self.numel - self.own_start, 0):].zero_()
        fills_out = getattr(reader, "fills_out", False)
        for seg in self.owned:
            p, out = self.params[seg.index], dest[seg.offset:seg.offset + seg.length]
            if fills_out:
                reader(p, seg.start, seg.stop, out)
            else:
                out.copy_(reader(p, seg.start, seg.stop))

    @torch.no_grad()
    def adopt_full(self, src: int) -> None:
        """Take the full parameters of data-parallel rank ``src`` (edited in place) as everyone's new value.

        With hybrid sharding ``src`` sits in replica ``src // k`` at shard position ``src % k``:
        its shard group takes the edit first, then every replica group from that replica.
        """
        k = self.comm.size
        self.drop_secondary()
        self.comm.broadcast(self.flat_param, src=src % k if self.replicate is not None else src)
        if self.replicate is not None:
            self.replicate.broadcast(self.flat_param, src=src // k)
        owned = self.flat_param.narrow(0, self.own_start, self.own_numel)
        if self.param_shard is not None:
            self.param_shard.copy_(owned)
        if self.master is not None and not self.master_is_view:
            self.master.copy_(owned)

    def _alloc_flat_grad(self) -> None:
        self.flat_grad = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        for p, off in zip(self.params, self.offsets, strict=True):
            p.grad = self._view(self.flat_grad, off, p)

    # -- backward ---------------------------------------------------------------------
    def begin_backward(self, reduce_now: bool) -> None:
        """Arm the group for one backward; ``reduce_now`` at an accumulation boundary."""
        self._ready = 0
        self._reduce_now = reduce_now or self.policy.shard_grads

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if self.flat_grad is None:  # stage >= 2: the bucket lives only during its backward
            self.flat_grad = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
            self._filled = [False] * len(self.params)
        i = self._index[id(p)]
        view = self._view(self.flat_grad, self.offsets[i], p)
        if p.grad is not view and p.grad.data_ptr() != view.data_ptr():
            # autograd stole a fresh tensor (grad was None): copy it into the bucket (the first
            # gradient of a fresh stage >= 2 bucket) or fold it in
            if self.policy.shard_grads and not self._filled[i]:
                view.copy_(p.grad)
            else:
                view.add_(p.grad)
            p.grad = None if self.policy.shard_grads else view
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
        """Sum gradients over ranks: all-reduce (stage 0), or reduce-scatter to the shard."""
        self._ready = len(self.params)
        assert self.flat_grad is not None
        if not self.policy.shard_optimizer:
            w = self.comm.all_reduce(self.flat_grad, async_op=self.overlap_comm)
        elif not self.policy.shard_grads:
            owned = self.flat_grad.narrow(0, self.own_start, self.own_numel)
            w = self._reduce_scatter(self.flat_grad, owned)
        else:
            if self.shard_grad is None:
                self.shard_grad = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device)
            self._zero_unfilled()
            w = self._reduce_scatter(self.flat_grad, self.shard_grad, accumulate=True)

            self._bucket_in_flight = self.flat_grad if w is not None else None
            self.flat_grad = None  # the bucket lives only until its reduce-scatter is done
            self.release()  # stage 3: backward of this group is over
            self.drop_secondary()
        if w is not None:
            self._pending.append(w)
            if self.inflight is not None:  # bound the buckets (and ring buffers) held by pending work
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

    def wait(self) -> None:
        for w in self._pending:
            w.wait()
        self._pending.clear()
        self._bucket_in_flight = None

    # -- step -------------------------------------------------------------------------
    def owned_grad(self) -> torch.Tensor:
        """This rank's reduced (unscaled) gradient for ``master``, in the group's dtype."""
        if self.policy.shard_grads:
            if self.shard_grad is None:  # no backward reached this group yet
                self.shard_grad = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device)
            return self.shard_grad
        return self.flat_grad.narrow(0, self.own_start, self.own_numel)

    def attach_master_grad(self, scale: float) -> torch.Tensor:
        """Give ``master.grad`` the owned gradient times ``scale``; returns it (fp32).

        With hybrid sharding the shard is first summed over the replicas: one all-reduce of
        the shard (Ψ/k elements) per step, the only traffic that leaves the shard group.
        """
        g = self.owned_grad()
        if self.replicate is not None:
            self.replicate.all_reduce(g)
        if self.master_is_view:
            g.mul_(scale)
            self.master.grad = g
        else:
            mg = g.to(device=self.master.device, dtype=self.master.dtype, non_blocking=True)
            self.master.grad = mg.mul_(scale)
        return self.master.grad

    def publish_master(self, async_op: bool = False) -> Work | None:
        """Write the stepped master into ``flat_param`` and share it with every rank."""
        if self.policy.shard_params:  # the next gather() reads the shard
            self.drop_secondary()
            if not self.master_is_view:
                self.param_shard.copy_(self.master, non_blocking=True)
            return None
        owned = self.flat_param.narrow(0, self.own_start, self.own_numel)
        if not self.master_is_view:
            owned.copy_(self.master, non_blocking=True)
        if self.policy.shard_optimizer:
            self._gather_work = self.comm.all_gather(self.flat_param, async_op=async_op)
            return self._gather_work
        return None

    def zero_grad(self) -> None:
        if self.master is not None:
            self.master.grad = None
        if self.flat_grad is not None and not self.policy.shard_grads:
            self.flat_grad.zero_()
        if self.shard_grad is not None:
            self.shard_grad.zero_()

    # -- reports ----------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        live = 0 if self.pool is not None else self.flat_param.untyped_storage().nbytes()  # pool: its own
        return {
            "params": live + nbytes(self.param_shard) + nbytes(self.secondary_shard),
            "grads": nbytes(self.flat_grad) + nbytes(self.shard_grad),
            "master_params": 0 if self.master_is_view else nbytes(self.master),
        }

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
