"""``shardwise.shard(model, ...)``: ZeRO as a function, FSDP2-style, and the one construction path.

:func:`shard_module` turns a model into its sharding: places it on the device (or materializes it
from ``zero.Init``), applies a TP plan, casts to the compute dtype and calls
:func:`~shardwise.zero.builder.build_sharding`. The DeepSpeed-style ``Engine`` and the public
:func:`shard` both call it, so there is one way a model becomes groups.

:func:`shard` shards in place and returns the model, whose class gains :class:`ShardedModule`'s
methods (``set_requires_gradient_sync``, ``no_sync``, ``sharding``). Then a plain loop works::

    model = shardwise.shard(model, stage=3)
    opt = shardwise.ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    loss = model(**batch).loss; loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm import Comm, compute_device
from shardwise.layout import Mesh, RunLayout
from shardwise.moe import restore_expert_groups
from shardwise.optim.optimizers import client_param_groups
from shardwise.sharded_init.context import (
    SafetensorsSource,
    is_deferred,
    is_placeholder,
    materialize_by_init,
    swap_meta_parameters,
    tied_aliases,
)
from shardwise.tensor_parallel.plan import is_tp_sharded
from shardwise.zero.builder import Sharding, ShardOptions, build_sharding

log = logging.getLogger("shardwise")

_SLOT = "_shardwise_sharding"  # where a sharded module keeps its Sharding (read through sharding_of)


class _Slot:
    """Holds a model's Sharding. A deep copy or a pickle of the model is a plain, unsharded model
    (the copy gets None), so its forward and backward never touch the original's groups."""

    __slots__ = ("sharding",)

    def __init__(self, sharding: Sharding):
        self.sharding = sharding

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> tuple:
        return (type(None), ())


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds a live :class:`Sharding` (a deep copy or an unsharded model does not)."""
    slot = model.__dict__.get(_SLOT)
    return slot is not None and slot.sharding is not None


def forget_sharding(model: nn.Module) -> None:
    """Drop the model's sharding slot (after :func:`~shardwise.fsdp.unshard.unshard_module`)."""
    model.__dict__.pop(_SLOT, None)


def sharding_of(model: nn.Module) -> Sharding:
    """The :class:`Sharding` of a model given to :func:`shard` (or wrapped by an engine)."""
    slot = model.__dict__.get(_SLOT)
    s = slot.sharding if slot is not None else None
    if s is None:
        raise ValueError(f"{type(model).__name__} is not sharded: call shardwise.shard(model, ...) first "
                         "(or pass engine.module of an engine)")
    return s


def _check(options: ShardOptions, replica: Comm, secondary: Comm | None) -> None:
    if replica.size > 1 and options.stage == 0:
        raise ValueError("hybrid sharding (zero_optimization.mics_shard_size, shard(shard_size=...)) needs "
                         "zero_optimization.stage >= 1: stage 0 shards nothing")
    if secondary is not None and secondary.size > 1 and (options.stage != 3 or replica.size > 1):
        raise ValueError("zero_optimization.zero_hpz_partition_size > 1 (ZeRO++ hpZ) needs "
                         "zero_optimization.stage 3 and no mics_shard_size")
    if options.offload_optimizer and options.stage == 0:
        raise ValueError("zero_optimization.offload_optimizer (shard(offload='optimizer')) needs stage >= 1: "
                         "the optimizer state is offloaded shard by shard")


def _deferred_sources(model: nn.Module, device: torch.device):
    """zero.Init: read shards from the checkpoint folder, or run the model's init per unit."""
    source = getattr(model, "_shardwise_source", None)
    if source is None:
        return (lambda ps: materialize_by_init(model, ps, device)), None
    files = SafetensorsSource(source, model)
    model._shardwise_files = files
    aliases = tied_aliases(model)

    def read(p: nn.Parameter, start: int, end: int) -> torch.Tensor:
        if not is_placeholder(p):  # given its values in GatheredParameters before initialize
            return p.detach().reshape(-1)[start:end]
        names = aliases[id(p)]
        return files.read(names[0], p.shape, start, end, names[1:])

    return None, read


def _remap(items: Any, swapped: dict[int, nn.Parameter]) -> Any:
    """Point listed parameters (or groups, or (name, param) pairs) at the swapped-in parameters."""
    if not items:
        return items
    if isinstance(items[0], dict):
        return [{**g, "params": [swapped.get(id(p), p) for p in g["params"]]} for g in items]
    if isinstance(items[0], tuple):
        return [(n, swapped.get(id(p), p)) for n, p in items]
    return [swapped.get(id(p), p) for p in items]


def _place(model: nn.Module, device: torch.device, stage: int, model_parameters: Any, optimizer: Any) -> Any:
    """Move the model to ``device``; a zero.Init model gets placeholders (values come unit by unit).

    ``model_parameters`` is listed before any swap: holding the objects keeps their ids unique, so
    a freed meta parameter's id cannot be confused with a new one's. Returns it remapped.
    """
    if not is_deferred(model):
        model.to(device)
        return model_parameters
    if stage != 3:
        raise ValueError("the model was built under shardwise.zero.Init (its parameters are not "
                         "materialized yet), which needs zero_optimization.stage 3")
    if model_parameters is not None:
        items = list(model_parameters)
        if items and isinstance(items[0], dict):
            items = [{**g, "params": list(g["params"])} for g in items]
        model_parameters = items
    swapped = swap_meta_parameters(model, device)
    if optimizer is not None and not callable(optimizer):  # a client optimizer built on meta
        optimizer.param_groups[:] = _remap(optimizer.param_groups, swapped)
    for m in model.modules():
        for name, b in list(m.named_buffers(recurse=False)):
            setattr(m, name, b.to(device))
    return _remap(model_parameters, swapped)


def _apply_tp(model: nn.Module, tp: Comm, comm: Comm, plan: Any, deferred: bool):
    """Slice the model over ``tp`` (every rank from rank 0's weights); None when already split
    (``plan`` None: checked; False: the caller split it, e.g. DeepSpeed's ``mpu``)."""
    if tp.size == 1 or plan is False:
        return None
    if plan is None:
        if not any(is_tp_sharded(p) for p in model.parameters()):
            raise ValueError("the mesh has tensor-parallel size > 1 but no parameter of the model is split: "
                             "apply shardwise.tensor_parallel.apply_tensor_parallel(model, mesh.tp) first, or "
                             "pass tp_plan='auto'")
        return None
    if deferred:
        raise ValueError("tensor_parallel.autotp_size > 1 with a model built under zero.Init is not "
                         "supported yet; build the model normally (TP shards it first)")
    from shardwise.tensor_parallel import apply_tensor_parallel

    world = Comm(None, comm.stats)
    with torch.no_grad():  # every TP rank must slice the same weights
        for t in list(model.parameters()) + list(model.buffers()):
            world.broadcast(t.data, src=0)
    report = apply_tensor_parallel(model, tp, plan=None if plan == "auto" else plan)
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info(f"tensor parallel {report.tp_size}-way from the {report.plan_source}: {len(report.sharded)} "
                 f"parameters sharded, {len(report.replicated)} replicated")
    return report


def shard_module(model: nn.Module, options: ShardOptions, comm: Comm, replica: Comm, tp: Comm,
                 secondary: Comm | None = None, *, compute_dtype: torch.dtype = torch.float32,
                 model_parameters: Any = None, optimizer: Any = None, tp_plan: Any = None) -> Sharding:
    """The one construction: place, TP-slice, cast, then build the groups. Returns the Sharding
    (also reachable as ``sharding_of(model)``), with ``param_groups`` (the optimizer groups its
    buckets follow) and ``tp_report`` (None without a TP plan applied here)."""
    if model.__dict__.get(_SLOT) is not None:
        raise ValueError(f"{type(model).__name__} is sharded already; shard a model once")
    _check(options, replica, secondary)
    restore_expert_groups(model)  # a deep copy of a split model lost its experts' marks
    device = compute_device()
    deferred = is_deferred(model)
    model_parameters = _place(model, device, options.stage, model_parameters, optimizer)
    report = _apply_tp(model, tp, comm, tp_plan, deferred)
    if compute_dtype != torch.float32:  # params only; buffers (rotary freqs) stay fp32
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(compute_dtype)
    param_groups = client_param_groups(model, model_parameters, optimizer)
    materialize, reader = _deferred_sources(model, device) if deferred else (None, None)
    sharding = build_sharding(model, param_groups, options, comm, replica, tp, secondary,
                              tp_sharded=is_tp_sharded, device=device, materialize=materialize,
                              shard_reader=reader)
    sharding.param_groups = [{k: v for k, v in pg.items() if k != "params"} for pg in param_groups]
    sharding.tp_report = report
    model.__dict__[_SLOT] = _Slot(sharding)
    return sharding


class ShardedModule:
    """What :func:`shard` adds to the model's class (FSDP2's ``FSDPModule`` names)."""

    @property
    def sharding(self) -> Sharding:
        return sharding_of(self)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: the following backwards only accumulate (stages 0-1 skip the reduction; stages
        2-3 still reduce-scatter, the shard is what accumulates). Set True before the last
        micro-batch's backward."""
        sharding_of(self).requires_sync = bool(requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """``set_requires_gradient_sync(False)`` for the backwards inside (DDP's name)."""
        s = sharding_of(self)
        before, s.requires_sync = s.requires_sync, False
        try:
            yield
        finally:
            s.requires_sync = before


_CLASSES: dict[type, type] = {}


def _offload_flags(offload: str | None, stage: int) -> tuple[bool, bool]:
    if offload not in (None, "none", "optimizer", "param", "all"):
        raise ValueError(f"shard(offload={offload!r}): use None, 'optimizer', 'param' or 'all'")
    param = offload in ("param", "all")
    if param and stage != 3:
        raise ValueError("shard(offload='param') keeps the stage-3 parameter shard on the CPU: needs stage=3")
    return offload in ("optimizer", "all"), param


def _dtype(mixed_precision: Any) -> torch.dtype:
    names = {None: torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16,
             torch.float32: torch.float32, torch.bfloat16: torch.bfloat16}
    if mixed_precision in (torch.float16, "fp16"):
        raise ValueError("shard(mixed_precision=fp16) needs a loss scaler; use bf16, or the engine "
                         "(config fp16.enabled) which scales the loss dynamically")
    if mixed_precision not in names:
        raise ValueError(f"shard(mixed_precision={mixed_precision!r}): use None, 'bf16' or torch.bfloat16")
    return names[mixed_precision]


def _mesh(mesh: Mesh | None, shard_size: int | None, replicate: int | None) -> Mesh:
    if mesh is not None:
        if shard_size is not None or replicate is not None:
            raise ValueError("shard(): give mesh= or shard_size=/replicate=, not both")
        return mesh
    if shard_size is not None and replicate is not None:
        raise ValueError("shard(): give shard_size= or replicate= (the other follows), not both")
    if replicate is not None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if replicate < 1 or world % replicate:
            raise ValueError(f"shard(replicate={replicate}) must divide the world size {world}")
        shard_size = world // replicate
    return RunLayout.of(1, shard_size).mesh  # the run's groups cut once, counted into one CommStats


def shard(model: nn.Module, stage: int = 3, mesh: Mesh | None = None, *, shard_size: int | None = None,
          replicate: int | None = None, tp_plan: Any = None, mixed_precision: Any = None,
          offload: str | None = None, units: Any = None, param_groups: list[dict] | None = None,
          bucket_size: int = 500_000_000, persistence_threshold: int = 100_000,
          prefetch_size: int = 50_000_000, overlap_comm: bool = False) -> nn.Module:
    """Shard ``model`` in place over the data-parallel ranks (ZeRO ``stage`` 0-3); returns it.

    ``mesh``: from ``shardwise.layout.get_mesh(tp, shard_size, secondary_size)`` (replicate x shard x
    tp; ``secondary_size``: ZeRO++ hpZ, stage 3); or
    ``shard_size`` / ``replicate`` for hybrid sharding without TP (default: shard over every rank).
    Under TP the model is either split already (``apply_tensor_parallel(model, mesh.tp)``) or
    ``tp_plan`` ('auto' or a plan dict) splits it here. ``mixed_precision``: None (fp32) or bf16
    (parameters and gradients in bf16, fp32 master shards). ``offload``: 'optimizer' (fp32 master
    and state on the CPU), 'param' (stage 3: parameter shard on the CPU) or 'all'. ``units``
    (stage 3): module classes or modules gathered together (default: found by structure).
    ``param_groups``: optimizer groups (dicts with ``params`` and options), kept apart in buckets
    so ``ShardedOptimizer`` can give them their own hyperparameters.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"shard(stage={stage}): ZeRO stages are 0, 1, 2 and 3")
    m = _mesh(mesh, shard_size, replicate)
    off_opt, off_param = _offload_flags(offload, stage)
    options = ShardOptions(stage=stage, bucket_numel=int(bucket_size), persistence_threshold=int(persistence_threshold),
                           prefetch_numel=int(prefetch_size), offload_optimizer=off_opt, offload_param=off_param,
                           overlap_comm=overlap_comm, units=units)
    shard_module(model, options, m.dp, m.replicate, m.tp, m.secondary, compute_dtype=_dtype(mixed_precision),
                 model_parameters=param_groups, tp_plan=tp_plan)
    cls = type(model)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Sharded{cls.__name__}", (ShardedModule, cls), {})
    model.__class__ = _CLASSES[cls]
    return model
