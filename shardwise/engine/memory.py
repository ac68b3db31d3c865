"""``engine.memory_report()``: the bytes one rank holds, by kind, read from what the engine owns.

Tensor bytes (not RSS): parameters, gradients, master shards and optimizer states of every sharded
group, the parameters ZeRO does not manage, buffers, the communication buffers kept for reuse and
the non-elementwise optimizers' whole tensors. Kept apart from the engine, which is about forward,
backward and step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardwise.engine.nvme import nvme_memory
from shardwise.engine.offload_states import offload_memory
from shardwise.units import ByteCounts
from shardwise.zero.whole_tensor import whole_tensor_of

if TYPE_CHECKING:
    from shardwise.engine.parts import EngineParts


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def comm_buffer_bytes(engine: EngineParts) -> int:
    """Buffers kept between steps for reuse: finished stage >= 2 gradient buckets (CPU) and gloo
    receive chunks. Bounded by the bucket size, not the model (see ``zero/pending.py``)."""
    groups = list(engine.groups) + [g for gs in engine.unit_groups for g in gs]
    limits = {id(g.inflight): g.inflight for g in groups if g.inflight is not None}
    comms = {id(c): c for c in [engine.comm, engine.replica, engine.tp] + [g.comm for g in groups]}
    return (sum(lim.free_nbytes for lim in limits.values())
            + sum(c.free_buffer_nbytes for c in comms.values()))


def _held_by_groups(engine: EngineParts, rep: dict[str, int]) -> None:
    """Add what the sharded groups hold, and the parameters and gradients outside them."""
    grouped = set()
    for g in engine.groups:
        for k, v in g.memory().items():
            rep[k] += v
        grouped.update(id(p) for p in g.params)
    for p in engine.module.parameters():
        if id(p) not in grouped:
            rep["params"] += _nbytes(p.data)
            rep["grads"] += _nbytes(p.grad)
    for gs in engine.unit_groups:  # stage 3 frozen groups hold params only
        for g in gs:
            if not g.trainable:
                rep["params"] += g.memory()["params"]


def memory_report(engine: EngineParts) -> dict[str, int]:
    """Bytes this rank holds now, by kind (tensor bytes, not RSS); a dict that prints in human units."""
    engine.wait_for_params()
    rep = {k: 0 for k in ("params", "grads", "master_params", "optimizer_states", "buffers")}
    _held_by_groups(engine, rep)
    for state in (engine.optimizer.state.values() if engine.optimizer is not None else ()):
        for v in state.values():
            if torch.is_tensor(v) and v.numel() > 1:
                rep["optimizer_states"] += _nbytes(v)
    rep["buffers"] = sum(_nbytes(b) for b in engine.module.buffers())
    rep["comm_buffers"] = comm_buffer_bytes(engine)
    whole = whole_tensor_of(engine.optimizer)  # non-elementwise optimizers: zero/whole_tensor.py
    extra = whole.memory() if whole is not None else {"whole_tensor_params": 0, "whole_tensor_step_buffers": 0}
    rep["whole_tensor_params"] = extra["whole_tensor_params"]
    offload_memory(engine, rep)  # engine.offload_states(): what moved to the host (engine/offload_states.py)
    offloaded = rep.pop("offloaded_states", None)
    nvme_memory(engine, rep)  # NVMe offload: stand-ins counted out, its buffers in (engine/nvme.py)
    on_disk, params_on_disk = rep.pop("nvme_offloaded", 0), rep.pop("nvme_param_offloaded", None)
    rep["total"] = sum(rep.values())
    if getattr(engine, "nvme", None) is not None or getattr(engine, "nvme_params", None) is not None:
        rep["nvme_offloaded"] = on_disk  # on disk, not in total
    if params_on_disk is not None:
        rep["nvme_param_offloaded"] = params_on_disk  # the parameters' part of it
    if offloaded is not None:
        rep["offloaded_states"] = offloaded  # on the host until reload_states(), not in total
    rep["whole_tensor_step_buffers"] = extra["whole_tensor_step_buffers"]  # transient, during step()
    rep["peak_gathered_params"] = engine.fetcher.peak_gathered_bytes if engine.fetcher else 0
    return ByteCounts(rep)
