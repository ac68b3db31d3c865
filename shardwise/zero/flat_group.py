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

import torch
from torch import nn

from shardwise.comm import Comm, Work
from shardwise.zero.gather_state import GatherState, StageThreeGather
from shardwise.zero.grad_accum import accumulation_dtype
from shardwise.zero.grad_reduce import GradReduction
from shardwise.zero.host_copy import GradToHost, accelerated, to_readable
from shardwise.zero.layout import FlatLayout
from shardwise.zero.pending import InflightLimit, ReadWork
from shardwise.zero.policy import DEFAULT_GROUP_OPTIONS, GroupOptions, OffloadPolicy, ShardPolicy
from shardwise.zero.store import MasterStore, ResidentStore, ShardStore


def owner_of(p: torch.Tensor) -> ShardedGroup | None:
    """The group holding parameter ``p`` (None if it is not sharded by shardwise)."""
    return getattr(p, "_shardwise_group", None)


class ShardedGroup(StageThreeGather, GradReduction):
    """Parameters of one bucket (or one module) sharing a flat buffer and its shards.

    ``master`` is what the optimizer steps on: a view of this rank's shard of
    ``flat_param`` when the parameters are fp32 and stay on their device (no
    second copy, so fp32 training holds K = 8 bytes of optimizer state and no
    master), otherwise a separate fp32 tensor, on the CPU with optimizer offload.
    """

    def __init__(self, params: list[nn.Parameter], names: list[str], comm: Comm, policy: ShardPolicy,
                 options: GroupOptions = DEFAULT_GROUP_OPTIONS, *, store: ShardStore | None = None,
                 trainable: bool = True, inflight: InflightLimit | None = None):
        """``options``: device, gather pool and the offload / precision / comm policies
        (``zero/policy.py``). ``store``: where the stage-3 shard persists and the initial values'
        source (default: on the device, from the parameters). ``inflight``: the model-wide limit on
        pending reductions."""
        if len({p.dtype for p in params}) != 1:
            raise ValueError(f"one group holds one dtype; got {sorted({str(p.dtype) for p in params})}")
        self.params, self.names, self.comm, self.policy = params, names, comm, policy
        self.store = store if store is not None else ResidentStore()
        if getattr(self.store, "writable", False) and not policy.shard_params:
            self.store = ResidentStore()  # NVMe parameter offload: a group kept whole keeps no shard at all
        if self.store.rereads and (trainable or not policy.shard_params) and not getattr(self.store, "writable", False):
            raise ValueError(f"{names[0]!r}: a file-backed store needs a frozen stage-3 group")
        # Hybrid sharding: ranks holding the same shard in other shard groups; their gradient
        # shards are summed once per step (see attach_master_grad).
        cp, replicate, secondary = options.comm, options.comm.replicate, options.comm.secondary
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        # ZeRO++ hpZ (stage 3): after a training forward this rank keeps its 1/k of the full parameters,
        # so the backward gathers inside the k ranks of ``secondary`` (a node) instead of over every rank.
        self.secondary = secondary if secondary is not None and secondary.size > 1 and policy.shard_params else None
        self.secondary_shard: torch.Tensor | None = None  # valid until the parameters change
        self.overlap_comm, self.inflight, self.trainable = cp.overlap_comm, inflight, trainable
        # ZeRO++ (zero/quantized_comm.py): bits of the stage-3 parameter all-gather (qwZ) and of the
        # gradient reduce-scatter (qgZ); 0 = exact. Nothing is quantized on a group of one rank.
        self.weight_bits = cp.weight_bits if comm.size > 1 and policy.shard_params and not self.store.rereads else 0
        self.grad_bits = cp.grad_bits if comm.size > 1 and policy.shard_optimizer else 0
        self.dtype = params[0].dtype
        self.grad_dtype = accumulation_dtype(self.dtype, options.precision.grad_dtype, names[0])
        self.tp_sharded = False  # a TP slice? set by the builder (zero/partition.py): ZeRO reads no TP specs
        self.own_groups = None  # partition.OwnGroups when sharded over a group of its own (experts)
        self.device = options.device if options.device is not None else params[0].device
        self.layout = FlatLayout(tuple(p.numel() for p in params), comm.size)
        self.own_start, self.own_numel = (self.layout.shard_range(comm.rank) if policy.shard_optimizer
                                          else (0, self.layout.padded_numel))  # stage 0: the whole buffer
        self.owned = self.layout.segments(self.own_start, self.own_numel)  # param pieces this rank owns
        self.pool = options.pool if policy.shard_params and not trainable else None
        self.state = GatherState.GATHERED  # changed only by _to_gathered / _to_released
        self._gather_work: Work | ReadWork | None = None
        owned = self._init_params(later=options.offload.master_later and trainable)
        self.precision = options.precision  # a bf16/fp16 master only for groups of that dtype:
        low = options.precision.master_dtype == self.dtype
        self._init_master(owned, self.dtype if low else torch.float32, options.offload)
        self._init_grads()

    def _init_params(self, later: bool = False) -> torch.Tensor | None:
        """Fill the flat buffer (every rank from rank 0's weights) and point the parameters at it;
        stage 3 then moves this rank's shard into the store and releases the rest. Returns what the
        master starts from (None: a file-backed store keeps no copy, or, ``later`` (the master made by
        NVMe offload), the store's file is read again then instead of a copy held until it is)."""
        # Read straight into the shard (zero.Init from a checkpoint): the full group is never built.
        from_files = self.store.reader is not None and self.policy.shard_params
        if from_files:  # a pooled group has no buffer until its first gather
            self.flat_param = torch.empty(0 if self.pool is not None else self.padded_numel,
                                          dtype=self.dtype, device=self.device)
        else:
            self.flat_param = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
            reader = self.store.reader
            with torch.no_grad():
                for p, off, n in zip(self.params, self.offsets, self.numels, strict=True):
                    if getattr(reader, "fills_out", False):  # straight into the buffer: no temporary
                        reader(p, 0, n, self.flat_param[off : off + n])
                        continue
                    src = reader(p, 0, n) if reader is not None else p.detach().reshape(-1)
                    self.flat_param[off : off + n].copy_(src)
            self.comm.broadcast(self.flat_param, src=0)  # every rank starts from rank 0's weights
            if self.replicate is not None:
                self.replicate.broadcast(self.flat_param, src=0)
        for p, off in zip(self.params, self.offsets, strict=True):
            if not from_files:
                p.data = self._view(self.flat_param, off, p)
            p._shardwise_group = self
        owned = self.flat_param.narrow(0, self.own_start, self.own_numel) if self.flat_param.numel() else None
        if not self.policy.shard_params:
            return owned
        # Stage 3: the persistent copy of the parameters is only this shard, in the store; the
        # flat buffer is refilled from it by gather().
        self.store.keep(self, None if from_files else owned)
        # what the master starts from: the store's shard, or (a store keeping none in memory: NVMe) a copy
        start = self.store.shard if self.store.shard is not None or from_files or later else owned.clone()
        self.release()
        return start

    def _init_master(self, owned: torch.Tensor | None, master_dtype: torch.dtype, offload: OffloadPolicy) -> None:
        """What the optimizer steps on: a view of the shard when dtype and device allow (no copy)."""
        # (with parameter offload the view is of the CPU shard: the optimizer steps there)
        self.master_is_view = master_dtype == self.dtype and offload.device is None
        self.master_start, self.to_host, self.master_pending = None, None, False
        if not self.trainable:
            self.master = None
        elif self.master_is_view:
            self.master = owned
        elif offload.master_later:  # NVMe offload makes it in its swap files (nvme/swapper.py), or make_master
            self.master = torch.full((1,), float("nan"), dtype=master_dtype).expand(self.own_numel)
            self.master_start, self.master_offload, self.master_pending = owned, offload, True
            return
        else:
            dev = offload.device if offload.device is not None else self.device
            self.master = torch.empty(self.own_numel, dtype=master_dtype, device=dev,
                                      pin_memory=offload.pin_memory and torch.cuda.is_available())
            self.master.copy_(owned)
            if self._master_is_the_store(offload):
                self.store = MasterStore(self.master)  # the 16-bit shard it was made from goes
        # offload on an accelerator: the owned gradient goes to the host on a side stream (host_copy.py)
        on_host = self.master is not None and self.master.device.type == "cpu" and accelerated(self.device)
        self.to_host = GradToHost(self.device, self.own_numel, self.master.dtype,
                                  offload.pin_memory) if on_host else None

    def make_master(self) -> None:
        """A master left for NVMe offload (``OffloadPolicy.master_later``) made in host memory after all, as
        CPU offload makes it, in place (the same tensor): an engine with no optimizer has no swapper to."""
        if not self.master_pending:
            return
        start, offload = self.master_start, self.master_offload
        if start is None:  # a file-held stage-3 shard (offload_param nvme): read back
            start = torch.empty(self.own_numel, dtype=self.dtype)
            self.store.fill(self, start, async_read=False)
        made = torch.empty(self.own_numel, dtype=self.master.dtype, device=offload.device,
                           pin_memory=offload.pin_memory and torch.cuda.is_available())
        made.copy_(start)
        self.master.set_(made)
        self.master_start, self.master_pending = None, False
        if accelerated(self.device):  # as _init_master: the owned gradient to the host on a side stream
            self.to_host = GradToHost(self.device, self.own_numel, made.dtype, offload.pin_memory)

    def _master_is_the_store(self, offload: OffloadPolicy) -> bool:
        """Stage 3, a separate master on the compute device (not offloaded), the shard resident there and
        gathered exactly (no qwZ): the master can be the persistent copy (``store.MasterStore``)."""
        store = self.store
        return (self.policy.shard_params and type(store) is ResidentStore and store.device is None
                and offload.device is None and self.weight_bits == 0)

    def _init_grads(self) -> None:
        """Without grad sharding the flat grad buffer is persistent and every param.grad is a view
        of it (gradients accumulate in place); stage >= 2 makes a bucket per backward."""
        self.flat_grad: torch.Tensor | None = None
        self.shard_grad: torch.Tensor | None = None  # stage >= 2: reduced shard, accumulated
        # stage >= 2: shard_grad holds no gradient since zero_grad (its bytes are stale, read as zeros):
        # the step's first reduce-scatter writes it instead of adding onto a zeroed one (two passes
        # over the shard fewer, the cost that kept stage 2 behind stage 1)
        self._shard_grad_empty = True
        self.grad_released = False  # stage 3: shard_grad let go after a step (not: no backward reached it yet)
        if self.trainable and not self.policy.shard_grads:
            self._alloc_flat_grad()
        self._filled: list[bool] = []
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._ready = 0
        self._reduce_now = False
        # stages 2-3: keep the full gradient bucket across backwards and reduce-scatter it once, at
        # the accumulation boundary (set by the pipeline engine; docs/pipeline.md)
        self.defer_reduce = False
        # Stages 0-1 with a reduction per backward (no sync toggle): a reduced sum set aside while
        # the next backward accumulates local gradients (see begin_backward).
        self._holds_reduced = False
        self._reduced_carry: torch.Tensor | None = None
        self._pending: list[Work] = []
        self._buckets_in_flight: list[torch.Tensor] = []  # stage >= 2: reducing, returned at wait()
        self._bucket_base: torch.Tensor | None = None  # stage >= 2: the buffer flat_grad narrows
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for p in self.params] if self.trainable else []

    @property
    def param_shard(self) -> torch.Tensor | None:
        """Stage 3: this rank's persistent shard (None when file-backed or not stage 3)."""
        return self.store.shard

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
        self.store.update(owned)
        if self.master is not None and not self.master_is_view:
            swap = getattr(self, "master_swap", None)  # NVMe offload: the master is in its swap file
            swap.overwrite_master(self, owned) if swap is not None else self.master.copy_(owned)

    def owned_grad(self) -> torch.Tensor:
        """This rank's reduced (unscaled) gradient for ``master``, in ``grad_dtype``."""
        if self.policy.shard_grads:
            if self.shard_grad is None:  # no backward reached this group yet
                self.shard_grad = torch.empty(self.shard_numel, dtype=self.grad_dtype, device=self.device)
            if self._shard_grad_empty:
                self.shard_grad.zero_()
                self._shard_grad_empty = False
            return self.shard_grad
        if self._reduced_carry is not None:
            raise RuntimeError(
                f"{self.names[0]!r}: the last backward before this step did not reduce its gradients "
                "(set_requires_gradient_sync(False) or no_sync()), but an earlier one of the same step "
                "did; reduce on the last micro-batch of every step (set_requires_gradient_sync(True))")
        return self.flat_grad.narrow(0, self.own_start, self.own_numel)

    def start_master_grad(self) -> None:
        """Offload on an accelerator: queue the owned gradient's copy to the host (side stream), so
        every group's copy is in flight before ``attach_master_grad`` waits for the first."""
        if self.to_host is not None:
            g = self.owned_grad()
            if self.replicate is not None:
                self.replicate.all_reduce(g)
            self.to_host.start(g)

    def master_writable(self) -> None:
        """Before the host writes the master in place: the last copy out of it has read it."""
        if self.to_host is not None:
            self.to_host.master_writable()

    def attach_master_grad(self, scale: float) -> torch.Tensor:
        """Give ``master.grad`` the owned gradient times ``scale``; returns it (fp32).

        With hybrid sharding the shard is first summed over the replicas: one all-reduce of
        the shard (Ψ/k elements) per step, the only traffic that leaves the shard group.
        """
        self.master_writable()  # the optimizer step writes the master next
        if self.to_host is not None and self.to_host.pending:  # started: the host buffer, copy fenced
            g = self.to_host.wait()
        else:
            g = self.owned_grad()
            if self.replicate is not None:
                self.replicate.all_reduce(g)
        if self.master_is_view:
            if g.device != self.master.device:  # offload_param: the master is the (CPU) stage-3 shard
                g = g.to(self.master.device)  # blocking: the host reads it at once
            g.mul_(scale)
            self.master.grad = g
        else:
            mg = to_readable(g, self.master.device, self.master.dtype)  # fenced: the host scales it next
            self.master.grad = mg.mul_(scale)
            self.release_grad_shard()  # upcast: the 16-bit shard is read no more this step
        return self.master.grad

    def release_grad_shard(self) -> None:
        """Stage 3: let go of the reduced 16-bit gradient shard, as FSDP2 frees its gradients. Dropped
        once upcast into the master's gradient (group by group, so a step holds one group's 16-bit
        shard beside the fp32 gradients, not all of them) and at ``zero_grad``, so that between steps
        and in the next backward only the groups already reduced hold one (``reduce_grads`` makes it
        when the group's first reduce-scatter writes it). Stage 2 keeps its shard: whole-model buffers
        reused every step are what keep it ahead of stage 1 (``zero/pending.py``)."""
        if self.policy.shard_params:
            self.shard_grad = None
            self._shard_grad_empty = True
            self.grad_released = True  # owned_grad() makes a zeroed one again for a reader (tensor_fragment)

    def publish_piece(self, src: torch.Tensor, start: int) -> None:
        """NVMe sub-groups (``nvme/``): elements ``[start, start + n)`` of the stepped master into the shard
        (the stage-3 store, else ``flat_param``'s owned range); ``publish_master(copied=True)`` after the
        last piece shares it."""
        if self.policy.shard_params:
            self.store.update_range(src, start, non_blocking=True)
        else:
            self.flat_param.narrow(0, self.own_start + start, src.numel()).copy_(src, non_blocking=True)
        self._copied_out()

    def publish_master(self, async_op: bool = False, copied: bool = False) -> Work | None:
        """Write the stepped master into ``flat_param`` and share it with every rank (``copied``: the
        master is there already, piece by piece: ``publish_piece``)."""
        if self.policy.shard_params:  # the next gather() reads the shard
            self.drop_secondary()
            if not self.master_is_view and not copied:
                self.store.update(self.master, non_blocking=True)
                self._copied_out()
            return None
        owned = self.flat_param.narrow(0, self.own_start, self.own_numel)
        if not self.master_is_view and not copied:
            owned.copy_(self.master, non_blocking=True)  # from pinned memory: ordered on the compute stream
            self._copied_out()
        if self.policy.shard_optimizer:
            work = self.comm.all_gather(self.flat_param, async_op=async_op)
            self._to_gathered(work)  # stages 1-2: GATHERING until each module's forward waits for it
            return work
        return None

    def _copied_out(self) -> None:
        if self.to_host is not None:
            self.to_host.published()

    def zero_grad(self) -> None:
        self._holds_reduced, self._reduced_carry = False, None
        if self.master is not None:
            self.master.grad = None
        if self.flat_grad is not None and not self.policy.shard_grads:
            self.flat_grad.zero_()
        self._shard_grad_empty = True  # (not zeroed: the next reduce-scatter overwrites it)
        self.release_grad_shard()

    # -- reports ----------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        live = 0 if self.pool is not None else self.flat_param.untyped_storage().nbytes()  # pool: its own
        return {
            "params": live + self.store.nbytes + nbytes(self.secondary_shard),
            "grads": nbytes(self.flat_grad) + nbytes(self.shard_grad),
            "master_params": 0 if self.master_is_view else nbytes(self.master),
        }

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
