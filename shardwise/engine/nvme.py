"""The engine's NVMe offload (ZeRO-Infinity): the config read into ``nvme/``'s settings, and the
swapper wired to the engine's step, checkpoints and memory report. Thin on purpose: the mechanism is
``shardwise/nvme/``, the I/O engine ``shardwise/aio/``; docs/offload.md."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from shardwise.aio import ALIGN, AioConfig, IOEngine
from shardwise.errors import UserError
from shardwise.nvme import NvmeSettings, OptimizerSwapper, ParamSwap, SwapFolder, check_room, is_stand_in

if TYPE_CHECKING:
    from shardwise.engine.parts import EngineParts

log = logging.getLogger("shardwise")

OO = "zero_optimization.offload_optimizer"
OP = "zero_optimization.offload_param"
_AIO_KEYS = {"block_size", "queue_depth", "thread_count", "intra_op_parallelism", "single_submit",
             "overlap_events", "use_gds"}


def aio_config(section: dict[str, Any]) -> AioConfig:
    """DeepSpeed's ``aio`` section: ``intra_op_parallelism`` and its older name ``thread_count`` both set
    the threads per request (the new name wins where both are given); ``use_gds`` (GPUDirect Storage) is
    refused, there is none here."""
    unknown = sorted(set(section) - _AIO_KEYS)
    if unknown:
        raise UserError(f"aio.{unknown[0]}: not an aio key; the keys are {', '.join(sorted(_AIO_KEYS))}")
    if section.get("use_gds"):
        raise UserError("aio.use_gds: GPUDirect Storage is not implemented by shardwise; set it false (reads and "
                        "writes go through host buffers)")
    threads = section.get("intra_op_parallelism", section.get("thread_count", 1))
    if "thread_count" in section and "intra_op_parallelism" in section and \
            section["thread_count"] != section["intra_op_parallelism"]:
        log.warning("aio.thread_count=%s and aio.intra_op_parallelism=%s: the newer intra_op_parallelism is used",
                    section["thread_count"], section["intra_op_parallelism"])
    try:
        return AioConfig(block_size=int(section.get("block_size", 1 << 20)),
                         queue_depth=int(section.get("queue_depth", 8)), intra_op_parallelism=int(threads),
                         single_submit=bool(section.get("single_submit", False)),
                         overlap_events=bool(section.get("overlap_events", True)))
    except (TypeError, ValueError) as e:
        raise UserError(str(e)) from None


def nvme_settings(config) -> NvmeSettings | None:
    """``offload_optimizer.device: nvme`` as settings (None when it is not); ``nvme_path`` required."""
    oo = config.zero_optimization.offload_optimizer
    if oo is None or oo.device != "nvme":
        return None
    if not oo.nvme_path:
        raise UserError(f"{OO}.nvme_path: required with {OO}.device 'nvme' (a folder on the NVMe disk)")
    return NvmeSettings(nvme_path=Path(oo.nvme_path), key=f"{OO}.nvme_path", buffer_count=max(1, oo.buffer_count),
                        pipeline_read=bool(oo.pipeline_read), pipeline_write=bool(oo.pipeline_write),
                        pin_memory=bool(oo.pin_memory), local_ranks=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                        sub_group_size=int(config.zero_optimization.sub_group_size),
                        aio=aio_config(dict(config.aio)))


def attach_nvme(engine: EngineParts) -> OptimizerSwapper | None:
    """The engine's optimizer states onto NVMe, if the config asks (before training: the path checked)."""
    settings = nvme_settings(engine.config)
    if settings is None or engine.optimizer is None:
        for g in engine.sharding.groups:  # no swapper to make the masters in their files: made on the host
            g.make_master()
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    return OptimizerSwapper(engine.sharding.groups, engine.optimizer, settings, rank)


def swaps_closed_on_failure(init: Callable[..., None]) -> Callable[..., None]:
    """``Engine.__init__`` wrapped: when it raises after a swap folder was locked (``attach_param_swap``
    takes the parameters' before sharding, ``attach_nvme`` the optimizer's after it), the folders are
    removed and their locks released before the error leaves, not when the half-built engine is collected
    (the traceback holds it), so a retry in the same process is not refused as "in use"."""
    @functools.wraps(init)
    def guarded(engine: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(engine, *args, **kwargs)
        except BaseException:
            close_swaps(engine)
            raise
    return guarded


def close_swaps(engine: Any) -> None:
    """The engine's NVMe swappers (optimizer, parameters) closed: threads stopped, files removed, locks
    released (each idempotent; a close that fails is logged: the constructor's own error is the one raised)."""
    for name in ("nvme", "nvme_params"):
        swap = engine.__dict__.get(name)
        if swap is not None:
            try:
                swap.close()
            except Exception:  # noqa: BLE001 - the constructor's own error is the one to raise
                log.exception("shardwise: closing the %s swap folder after a failed start", name)


def attach_param_swap(engine: EngineParts, options: Any, model: Any) -> Any:
    """``options``; with ``offload_param.device: nvme`` (stage 3) the parameters' swap folder made (checked
    for this rank's 16-bit shards, every rank of the node counted), ``engine.nvme_params``, and its stores'
    factory set on the builder's ``options``."""
    engine.nvme_params = swap = param_swap(engine.config, model)
    options.param_store = swap.store if swap is not None else None
    return options


def param_swap(config, model: Any) -> ParamSwap | None:
    """The :class:`ParamSwap` of ``offload_param.device: nvme`` (None for another device)."""
    op = config.zero_optimization.offload_param
    if op.device != "nvme":
        return None
    if not op.nvme_path:
        raise UserError(f"{OP}.nvme_path: required with {OP}.device 'nvme' (a folder on the NVMe disk)")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    check_room(f"{OP}.nvme_path", Path(op.nvme_path), param_file_bytes(model, world),
               int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    folder = SwapFolder(f"{OP}.nvme_path", op.nvme_path, rank, kind="param-")
    return ParamSwap(folder, IOEngine(aio_config(dict(config.aio))), op.buffer_count, op.buffer_size, op.max_in_cpu)


def param_file_bytes(model: Any, world: int) -> int:
    """One rank's parameter swap files, at most: its shard in the parameters' own dtype (4 bytes an element
    for an fp32 model), plus a header block and a block of padding per group (a module's own parameters)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    groups = sum(1 for m in model.modules() if next(m.parameters(recurse=False), None) is not None)
    return -(-total // world) + 2 * ALIGN * groups


def reduce_and_norm(engine: EngineParts, unscale: float) -> tuple[list[torch.Tensor] | None, float]:
    """The step's gradients (times ``unscale``) and their global norm. With NVMe offload no gradient is
    kept on the host: the norm streams them through one buffer (``nvme/pieces.py``) and the list is None."""
    swapper = getattr(engine, "nvme", None)
    if swapper is not None:
        return None, swapper.grad_norm(engine.sharding, unscale)
    grads = engine.sharding.reduced_grads(unscale)
    return grads, engine.sharding.grad_norm(grads)


def clip_grads(engine: EngineParts, grads: list[torch.Tensor] | None, coef: float) -> None:
    """Gradient clipping by ``coef``: in place, or (NVMe offload) as each piece's gradient is loaded."""
    if grads is None:
        engine.nvme.clip(coef)
    else:
        torch._foreach_mul_(grads, coef)


def nvme_resident(engine: EngineParts, write_back: bool):
    """A context with every NVMe-held state in host memory (a checkpoint load); nothing without NVMe offload."""
    swapper = getattr(engine, "nvme", None)
    return swapper.resident(write_back) if swapper is not None else nullcontext()


def nvme_streamed(engine: EngineParts):
    """A context for a save: NVMe-held groups read one at a time as the checkpoint writer reaches them
    (``nvme/resident.py``'s ``streamed``); nothing without NVMe offload."""
    swapper = getattr(engine, "nvme", None)
    return swapper.streamed() if swapper is not None else nullcontext()


def nvme_memory(engine: EngineParts, rep: dict[str, int]) -> None:
    """``memory_report()``: what is on disk is not held (stand-ins counted out); the buffers are."""
    params = getattr(engine, "nvme_params", None)
    if params is not None:  # the parameters' bounce buffers (their max_in_cpu shards are in "params" already)
        rep["nvme_param_buffers"] = params.bounce_bytes()
        rep["nvme_param_offloaded"] = rep["nvme_offloaded"] = params.disk_bytes()
    swapper = getattr(engine, "nvme", None)
    if swapper is None:
        return
    on_disk = rep.get("nvme_offloaded", 0)
    for _, g in swapper.units:
        if is_stand_in(g.master):
            rep["master_params"] -= g.master.numel() * g.master.element_size()
            on_disk += g.master.numel() * g.master.element_size()
        for v in engine.optimizer.state.get(g.master, {}).values():
            if is_stand_in(v):
                rep["optimizer_states"] -= v.numel() * v.element_size()
                on_disk += v.numel() * v.element_size()
    rep["nvme_buffers"] = rep.get("nvme_buffers", 0) + swapper.host_bytes()
    rep["nvme_offloaded"] = on_disk

