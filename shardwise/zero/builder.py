"""One construction of a model's ZeRO sharding, and the backward completion that finishes it.

:func:`build_sharding` is the one place that turns a model into :class:`ShardedGroup` s: it picks
the stage-3 units, cuts the parameters into groups (``partition.build_groups``), broadcasts rank
0's weights, installs the stage-3 ``ParamFetcher`` or the stage 1-2 parameter waits, and returns a
:class:`Sharding`. Both ``shardwise.shard`` (the functional API) and the DeepSpeed-style
``Engine`` get their groups from here.

Backward completion is detected here too, so a plain ``loss.backward()`` leaves no group
unfinished: the first gradient hook of a backward arms the groups (reduce now, or accumulate
under ``requires_sync = False``) and queues one callback on the autograd engine, which runs when
the whole backward is done and reduces what is pending (groups whose parameters got no gradient)
and releases stage-3 parameters still gathered (FSDP does the same).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from shardwise.comm import Comm, compute_device
from shardwise.errors import UserError
from shardwise.optim.grad_norm import global_grad_norm
from shardwise.zero.eager_hooks import eager_hook
from shardwise.zero.flat_group import ShardedGroup, owner_of
from shardwise.zero.gather_pool import GatherPool
from shardwise.zero.layout import FlatLayout
from shardwise.zero.partition import BuildHooks, Cutting, broadcast_model, build_groups
from shardwise.zero.policy import CommPolicy, GroupOptions, OffloadPolicy, PrecisionPolicy, ShardPolicy
from shardwise.zero.stage3.fetcher import ParamFetcher, assign_params, find_units
from shardwise.zero.stage3.gathered import guard_state_dict
from shardwise.zero.store import Reader, store_factory


@dataclass
class ShardOptions:
    """What to shard and how; the engine fills it from the DeepSpeed config (same defaults)."""

    stage: int = 3
    bucket_numel: int = 500_000_000  # min(reduce_bucket_size, allgather_bucket_size)
    persistence_threshold: int = 100_000  # stage 3: parameters this small stay whole
    prefetch_numel: int = 50_000_000
    max_live_numel: int = 1_000_000_000
    offload_optimizer: bool = False  # fp32 master and optimizer state on the CPU
    offload_param: bool = False  # stage 3: the persistent parameter shard on the CPU
    master_later: bool = False  # NVMe offload: masters made later, into their swap files (policy.OffloadPolicy)
    pin_memory: bool = False
    overlap_comm: bool = False
    weight_bits: int = 0  # ZeRO++ qwZ
    grad_bits: int = 0  # ZeRO++ qgZ
    grad_accum_dtype: torch.dtype | None = None  # None: the parameters' dtype (zero/grad_accum.py)
    precision: PrecisionPolicy = PrecisionPolicy()  # the master's dtype (zero/low_precision.py)
    units: Any = None  # stage 3: None (find them), module classes, or modules
    param_store: Any = None  # stage 3: a factory of the parameter shards' stores (NVMe: nvme/), else by offload


def _waiter(groups: list[ShardedGroup]):
    def hook(module: nn.Module, args: Any) -> None:  # noqa: ARG001
        for g in groups:
            g.wait_gathered()

    return hook


def choose_units(model: nn.Module, spec: Any) -> list[nn.Module]:
    """Stage-3 units, root last: found by structure (``spec`` None), every module of the given
    classes, or the given modules; a unit nested inside another chosen unit is left to it."""
    if spec is None:
        return find_units(model)
    spec = list(spec)
    if all(isinstance(s, type) for s in spec):
        chosen = [m for m in model.modules() if m is not model and isinstance(m, tuple(spec))]
    elif all(isinstance(s, nn.Module) for s in spec):
        chosen = spec
    else:
        raise TypeError("shard(units=...) takes module classes or modules of the model, not a mix")
    inner = {id(d) for m in chosen for d in m.modules() if d is not m}
    units = [m for m in chosen if id(m) not in inner]
    if not units:
        raise ValueError(f"shard(units={spec!r}): no module of the model matches; name classes it contains")
    return units + [model]


class Sharding:
    """A model's groups, who they talk to, and the per-backward state (what the engine and the
    functional API share)."""

    def __init__(self, module: nn.Module, groups_by_pg: list[list[ShardedGroup]],
                 unit_groups: list[list[ShardedGroup]], units: list[nn.Module], fetcher: ParamFetcher | None,
                 comm: Comm, replica: Comm, tp: Comm, policy: ShardPolicy, options: ShardOptions):
        self.module, self.groups_by_pg, self.unit_groups = module, groups_by_pg, unit_groups
        self.groups: list[ShardedGroup] = [g for gs in groups_by_pg for g in gs]
        self.units, self.fetcher, self.options = units, fetcher, options
        self.comm, self.replica, self.tp = comm, replica, tp
        self.policy = policy  # the one record of the ZeRO stage (``stage`` is derived)
        self.requires_sync = True  # False: accumulate without reducing (stages 0-1; see arm)
        self.step_grads: list[torch.Tensor] | None = None  # master grads of this step, once attached
        self.param_groups: list[dict] = []  # optimizer options per entry of groups_by_pg (set by shard_module)
        self.tp_report: Any = None
        # The engine's rule for a backward it did not start (a plain ``loss.backward()``): returns
        # (reduce now?, factor on every parameter gradient); see ``shardwise/plain_backward.py``.
        self.plain_backward: Callable[[], tuple[bool, float]] | None = None
        self._grad_scale = 1.0
        self._armed = False
        self._queued = False
        self._handles: list[Any] = []
        self._install_param_waits()
        self._install_backward_hooks()

    @property
    def stage(self) -> int:
        return self.policy.stage

    @property
    def dp_world(self) -> int:
        return self.comm.size * self.replica.size

    @property
    def dp_rank(self) -> int:
        return self.replica.rank * self.comm.size + self.comm.rank

    @property
    def all_groups(self) -> list[ShardedGroup]:
        """Trainable groups, then the stage-3 frozen ones."""
        return self.groups + [g for gs in self.unit_groups for g in gs if not g.trainable]

    # -- construction -------------------------------------------------------------------
    def _install_param_waits(self) -> None:
        """Stages 1-2: a module's forward waits for the all-gather of the buckets it uses."""
        if self.stage not in (1, 2):
            return
        for m in self.module.modules():
            groups = {id(g): g for p in m.parameters(recurse=False) if (g := owner_of(p)) is not None}
            if groups:
                self._handles.append(m.register_forward_pre_hook(_waiter(list(groups.values()))))

    def _install_backward_hooks(self) -> None:
        """Hooks that notice a backward has started: the root's outputs (the outermost graph task,
        also under reentrant checkpointing), every trainable parameter's gradient (a loss that
        reaches a parameter outside the forward), and stage 3's pre-backward gathers."""
        self._handles.append(self.module.register_forward_hook(eager_hook(self._root_post_forward)))
        for g in self.groups:
            self._handles += [p.register_hook(self._on_param_grad) for p in g.params if p.requires_grad]
        if self.fetcher is not None:
            self.fetcher.on_backward = self.on_backward

    def __deepcopy__(self, memo: dict) -> Sharding:
        """A deep-copied model carries copies of these hooks; they stay bound to this Sharding and,
        called with the copy, do nothing (see ``_root_post_forward``)."""
        return self

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:  # noqa: ARG002
        if module is not self.module:  # a deep copy of the model: not sharded
            return output
        if self._queued and torch._C._current_graph_task_id() == -1:
            self._armed = self._queued = False  # outside any backward: one that raised left its callback unrun
        if torch.is_grad_enabled():
            tensors = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, lambda _grads: self.on_backward(), mode="any")
        return output

    def _on_param_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        self.on_backward()
        return grad * self._grad_scale if self._grad_scale != 1.0 else None

    # -- backward -------------------------------------------------------------------------
    def arm(self, sync: bool) -> None:
        """Prepare every group for one backward: reduce its gradients when it completes (``sync``)
        or only accumulate them. Stages 2-3 always reduce-scatter: the shard is what accumulates."""
        for g in self.groups:
            g.begin_backward(sync)
        self._armed = True
        self._queued = False

    def arm_passes(self, sync: bool) -> None:
        """Arm for one backward made of several autograd passes (a pipeline's split backward): the
        passes' hooks queue no finish of their own; the caller's ``finish_backward()`` ends it."""
        self.arm(sync)
        self._queued = True

    def on_backward(self) -> None:
        """Called from hooks inside a backward: arm (unless the engine did) and queue the finish."""
        if not self._armed:
            sync = self.requires_sync
            if self.plain_backward is not None:
                sync, self._grad_scale = self.plain_backward()
            self.arm(sync)
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        """End of backward: reduce what is pending, release stage-3 groups still gathered.

        Runs once per backward (a no-op when nothing armed the groups)."""
        self._queued = False
        self._grad_scale = 1.0
        if not self._armed:
            return
        self._armed = False
        for g in self.groups:
            g.end_backward()
        if self.fetcher is not None:
            if not self.fetcher.held:  # (held: a pipeline batch keeps the model gathered to its end)
                self.fetcher.release_all()  # frozen groups, and any a skipped branch left gathered
            self._settle_reductions()

    def _settle_reductions(self) -> None:
        """Stage 3, end of backward: finish the last reduce-scatters and free every gradient bucket and
        gloo receive chunk kept for reuse, as FSDP2 reshards and frees its reduce-scatter buffers when
        its backward ends. Otherwise the last buckets in flight (and their chunks) stay alive until
        ``step()`` waits for them, and the kept ones through the next forward: 2.36 x Psi/N bytes of
        llama-20m at 2 ranks above FSDP2 (docs/precision.md)."""
        limits = {id(g.inflight): g.inflight for g in self.groups if g.inflight is not None}
        for lim in limits.values():
            lim.settle()
        for g in self.groups:
            g.wait()
        comms = {id(c): c for c in [self.comm, self.replica] + [g.comm for g in self.groups]}
        for c in comms.values():
            c.drop_free_buffers()

    # -- step -----------------------------------------------------------------------------
    def wait_for_params(self) -> None:
        """Finish the asynchronous all-gathers of the last step (before reading parameters)."""
        for g in self.groups:
            g.wait_gathered()

    def reduced_grads(self, unscale: float) -> list[torch.Tensor]:
        """Wait for the reductions; give each master its gradient times ``unscale``."""
        for g in self.groups:
            g.wait()
            g.wait_gathered()
        for g in self.groups:  # offload on an accelerator: every group's host copy in flight first
            g.start_master_grad()
        return [g.attach_master_grad(unscale) for g in self.groups]

    def grad_norm(self, grads: list[torch.Tensor], squared: bool = False) -> float:
        """L2 norm over every shard on every rank of ``reduced_grads``' result.

        Groups sharded over their own groups (experts) are disjoint pieces over their ``shard`` group
        (stages >= 1) and hold other slices than the ranks of ``split``: their squares are summed over
        both, so each expert is counted exactly once. ``squared``: each grad is its ``grad_square`` (NVMe)."""
        pairs = [(grad, g.tp_sharded) for g, grad in zip(self.groups, grads, strict=True) if g.own_groups is None]
        norm = global_grad_norm(pairs, tp=self.tp, shard=self.comm if self.policy.shard_optimizer else None,
                                squared=squared)
        own = [(grad, g.own_groups) for g, grad in zip(self.groups, grads, strict=True) if g.own_groups is not None]
        if not own:
            return float(norm)
        groups = own[0][1]
        sq = global_grad_norm([(grad, False) for grad, _ in own],
                              shard=groups.shard if self.policy.shard_optimizer else None,
                              squared=squared).square().reshape(1)
        if groups.split.size > 1:
            sq = sq.to(compute_device())  # offloaded (CPU) expert grads: NCCL reduces no host tensor
            groups.split.all_reduce(sq)
        return float((norm.square() + sq[0]).sqrt())

    def publish(self) -> None:
        """After the optimizer step: the updated shards back into the parameters. Stages 1-2 start every
        all-gather (last bucket, the first layers, first) and wait for all of them before returning:
        code between ``step()`` and the next forward (logging ``module.weight``, an EMA, ``state_dict()``)
        reads the parameters directly, and must never see another rank's range from before the step."""
        for g in reversed(self.groups):
            g.publish_master(async_op=self.stage in (1, 2))
        for g in reversed(self.groups):
            g.wait_gathered()

    def zero_grad(self) -> None:
        for g in self.groups:
            g.zero_grad()

    def remove(self) -> None:
        """Finish pending work and take every hook off the model (stage-3 parameters stay released)."""
        self.wait_for_params()
        for g in self.groups + [g for gs in self.unit_groups for g in gs]:
            g.wait()
            g.remove_hooks()
        if self.fetcher is not None:
            self.fetcher.release_all()
            self.fetcher.remove()
        for h in self._handles:
            h.remove()
        self._handles.clear()


def build_sharding(model: nn.Module, param_groups: list[dict], options: ShardOptions, comm: Comm,
                   replica: Comm, tp: Comm, secondary: Comm | None = None, *,
                   tp_sharded: Callable[[nn.Parameter], bool] | None = None, device: torch.device | None = None,
                   materialize: Callable[[list[nn.Parameter]], None] | None = None,
                   shard_reader: Callable | None = None) -> Sharding:
    """Cut ``model`` (on its device, TP already applied) into groups over ``comm`` and hook them up.

    ``param_groups``: optimizer groups (a bucket never mixes two). ``tp_sharded`` tells TP slices
    from replicated parameters. ``materialize`` / ``shard_reader``: zero.Init sources.
    """
    stage = options.stage
    policy = ShardPolicy.for_stage(stage)
    units: list[nn.Module] = []
    unit_params = None
    if stage == 3:
        units = choose_units(model, options.units)
        owned = assign_params(model, units)
        unit_params = [owned[i] for i in range(len(units))]
    if options.param_store is not None and shard_reader is not None:
        raise UserError("zero_optimization.offload_param.device: nvme does not read a zero.Init model from its "
                        "checkpoint folder yet; load the model first, or offload parameters to the cpu")
    hooks = BuildHooks(materialize=materialize,
                       store=options.param_store or store_factory("cpu" if options.offload_param else "device",
                                                                  shard_reader, options.pin_memory),
                       **({"tp_sharded": tp_sharded} if tp_sharded is not None else {}))
    by_pg, by_unit = build_groups(model, param_groups, comm, policy,
                                  Cutting(options.bucket_numel, unit_params, options.persistence_threshold),
                                  group_options(options, device, replica, secondary), hooks)
    every = [g for gs in by_pg for g in gs] + [g for gs in by_unit for g in gs]
    for c in (comm, replica):  # shard group 0 takes rank 0's weights, then every replica
        broadcast_model(model, every, c)
    fetcher = None
    if stage == 3:
        fetcher = ParamFetcher(units, by_unit, options.prefetch_numel, options.max_live_numel)
        guard_state_dict(model)
    return Sharding(model, by_pg, by_unit, units, fetcher, comm, replica, tp, policy, options)


def group_options(options: ShardOptions, device: torch.device | None, replica: Comm | None,
                  secondary: Comm | None) -> GroupOptions:
    """The policies every group of one model shares, read once from the flat ``ShardOptions``."""
    offload = OffloadPolicy(torch.device("cpu") if options.offload_optimizer else None, options.pin_memory,
                            master_later=options.offload_optimizer and options.master_later)
    precision = replace(options.precision, grad_dtype=options.grad_accum_dtype)
    return GroupOptions(device=device, offload=offload, precision=precision,
                        comm=CommPolicy(options.overlap_comm, options.weight_bits, options.grad_bits, replica,
                                        secondary))


def build_frozen(model: nn.Module, comm: Comm, mode: str, reader: Reader | None, *, whole_root: bool,
                 layers_held: int, device: torch.device, progress: Callable[[int, int], None] | None = None,
                 ) -> tuple[list[nn.Module], list[list[ShardedGroup]], GatherPool | None]:
    """ZeRO-Inference's groups: ``(units, groups per unit, pool)``, every parameter frozen.

    Each decoder layer is stage-3 sharded over ``comm`` with a ``mode`` store (``store_factory``:
    resident, CPU or re-read through ``reader`` at every gather) and gathered into a
    :class:`GatherPool` of ``layers_held`` layers. The root (embeddings, norm, head) is needed by
    every forward: ``whole_root`` keeps it whole on this rank (streamed modes), else it is sharded
    like the layers but never pooled (it stays gathered for the whole forward). ``progress(i, n)``
    follows the n units being built.
    """
    units = choose_units(model, None)

    def on_unit(i: int) -> None:
        if progress is not None:
            progress(i + 1, len(units))

    owned = assign_params(model, units)
    layers, root = [owned[i] for i in range(len(units) - 1)], owned[len(units) - 1]
    pool = _layer_pool(layers, comm.size, layers_held, device)
    stage3, frozen = ShardPolicy.for_stage(3), [{"params": []}]
    _, by_unit = build_groups(model, frozen, comm, stage3, Cutting(1 << 62, layers),
                              GroupOptions(device=device, pool=pool),
                              BuildHooks(store=store_factory(mode, reader, pin_memory=mode == "cpu"), on_unit=on_unit))
    if whole_root:
        root_comm, policy, store = Comm(solo=True), ShardPolicy.for_stage(0), store_factory("device", reader)
    else:
        root_comm, policy, store = comm, stage3, store_factory(mode, reader, pin_memory=mode == "cpu")
    _, (root_groups,) = build_groups(model, frozen, root_comm, policy, Cutting(1 << 62, [root]),
                                     GroupOptions(device=device), BuildHooks(store=store))
    on_unit(len(units) - 1)
    return units, by_unit + [root_groups], pool


def _layer_pool(layers: list[list[nn.Parameter]], world: int, layers_held: int,
                device: torch.device) -> GatherPool | None:
    """Buffers for ``layers_held`` whole layers: one per group (a dtype) of a layer, each the size of
    the largest group of any layer (groups are cut by dtype, as ``build_groups`` cuts frozen ones)."""
    sizes, per_layer = [], 0
    for ps in layers:
        numel: dict[torch.dtype, int] = {}
        for p in ps:
            numel[p.dtype] = numel.get(p.dtype, 0) + p.numel()
        sizes += [FlatLayout((n,), world).padded_numel * dt.itemsize for dt, n in numel.items()]
        per_layer = max(per_layer, len(numel))
    return GatherPool(layers_held * per_layer, max(sizes), device) if sizes else None
