"""``deepspeed.comm``-style functions, reachable as ``shardwise.comm.<name>``.

Scripts written for DeepSpeed call ``deepspeed.comm.get_rank()``, ``dist.all_reduce(t)`` and so on
(``from deepspeed import comm as dist``). These are thin calls of ``torch.distributed`` with
DeepSpeed's signatures (its extra ``prof``/``log_name``/``debug`` keywords are accepted and
ignored); the library's own collectives go through :class:`shardwise.comm.Comm` instead. With the
communication logger on (``comms_logger``, ``configure``) the synchronous ones are recorded too, and
``log_summary()`` prints the table (``comm/log.py``).
``ReduceOp`` is torch's, so ``dist.ReduceOp.SUM`` works with either API.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as tdist

from shardwise.comm.core import init_distributed as core_init_distributed
from shardwise.comm.devices import choose_backend
from shardwise.comm.log import (
    configure,
    log_summary,
    record_call,
    reset_log,
    start_profiling_comms,
    start_profiling_op,
    stop_profiling_comms,
    stop_profiling_op,
)

ReduceOp = tdist.ReduceOp

__all__ = [
    "ReduceOp", "init_distributed", "is_initialized", "is_available", "destroy_process_group", "new_group",
    "get_rank", "get_world_size", "get_local_rank", "get_global_rank", "get_world_group",
    "get_all_ranks_from_group", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
    "all_reduce", "inference_all_reduce", "reduce", "all_gather", "all_gather_object",
    "all_gather_into_tensor", "allgather_fn", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_fn",
    "all_to_all_single", "send", "recv", "isend", "irecv", "gather", "scatter",
    "has_all_gather_into_tensor", "has_reduce_scatter_tensor", "get_backend",
    "configure", "log_summary", "reset_log", "start_profiling_comms", "stop_profiling_comms",
    "start_profiling_op", "stop_profiling_op",
]


def _core_init(backend: str | None, timeout: Any) -> None:
    core_init_distributed(backend, timeout)


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,  # noqa: ARG001
                     distributed_port: int = 29500, verbose: bool = True,  # noqa: ARG001
                     timeout: float | datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None,  # noqa: ARG001
                     rank: int = -1, world_size: int = -1, *, backend: str | None = None) -> None:
    """Join the job torchrun started (or a world of one); a no-op when already joined.

    DeepSpeed's signature; ``backend=`` is shardwise's older name for ``dist_backend``.
    ``dist_init_required=False`` demands an existing process group. Explicit ``rank`` /
    ``world_size`` / ``init_method`` are passed to torch as DeepSpeed does.
    """
    if dist_init_required is False:
        if not tdist.is_initialized():
            raise RuntimeError("Distributed backend is not initialized. Please set dist_init_required to "
                               "True or initialize before calling init_distributed()")
        return
    if tdist.is_initialized():
        return
    if rank >= 0 and world_size > 0:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
        os.environ.setdefault("LOCAL_RANK", str(rank))
    if init_method is None and "RANK" in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    if init_method is not None:
        be = choose_backend(backend or dist_backend)
        td = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout or 600)
        tdist.init_process_group(be, init_method=init_method, timeout=td, rank=rank, world_size=world_size)
        return
    _core_init(backend or dist_backend, timeout)


def is_initialized() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def is_available() -> bool:
    return tdist.is_available()


def destroy_process_group(group: Any = None) -> None:
    tdist.destroy_process_group(group)


def new_group(ranks: list[int]) -> Any:
    return tdist.new_group(ranks)


def get_backend(group: Any = None) -> str:
    return tdist.get_backend(group)


def get_rank(group: Any = None) -> int:
    """Rank in ``group`` (the world by default); 0 before the process group exists."""
    return tdist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    return tdist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    return group_rank if group is None else tdist.get_global_rank(group, group_rank)


def get_world_group() -> Any:
    return tdist.group.WORLD


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    return list(range(get_world_size())) if group is None else tdist.get_process_group_ranks(group)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None, **_: Any) -> Any:
    call = lambda: tdist.barrier(group=group, async_op=async_op, device_ids=device_ids)  # noqa: E731
    return call() if async_op else record_call("barrier", None, get_world_size(group), call)


def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
    return tdist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False, **_: Any) -> Any:
    call = lambda: tdist.broadcast(tensor, src=src, group=group, async_op=async_op)  # noqa: E731
    return call() if async_op else record_call("broadcast", tensor, get_world_size(group), call)


def broadcast_object_list(object_list: list, src: int, group: Any = None, device: Any = None) -> Any:
    return tdist.broadcast_object_list(object_list, src=src, group=group, device=device)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
               **_: Any) -> Any:
    call = lambda: tdist.all_reduce(tensor, op=op, group=group, async_op=async_op)  # noqa: E731
    return call() if async_op else record_call("all_reduce", tensor, get_world_size(group), call)


def inference_all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, **_: Any) -> Any:
    return tdist.all_reduce(tensor, op=op, group=group)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
           **_: Any) -> Any:
    return tdist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False,
               **_: Any) -> Any:
    return tdist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list: list, obj: Any, group: Any = None, **_: Any) -> Any:
    return tdist.all_gather_object(object_list, obj, group=group)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False, **_: Any) -> Any:
    fn = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
    if tensor.dim() == 0:  # a scalar flag per rank (NCCL takes it; gloo wants a 1-element tensor)
        tensor = tensor.reshape(1)
    call = lambda: fn(output_tensor, tensor, group=group, async_op=async_op)  # noqa: E731
    return call() if async_op else record_call("all_gather_into_tensor", output_tensor, get_world_size(group), call)


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                 async_op: bool = False, **_: Any) -> Any:
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM,
                   group: Any = None, async_op: bool = False, **_: Any) -> Any:
    return tdist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False, **_: Any) -> Any:
    fn = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor
    call = lambda: fn(output_tensor, tensor, op=op, group=group, async_op=async_op)  # noqa: E731
    return call() if async_op else record_call("reduce_scatter_tensor", tensor, get_world_size(group), call)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                      group: Any = None, async_op: bool = False, **_: Any) -> Any:
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: Any = None,
                      input_split_sizes: Any = None, group: Any = None, async_op: bool = False, **_: Any) -> Any:
    return tdist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                   async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **_: Any) -> Any:
    return tdist.send(tensor, dst=dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, **_: Any) -> Any:
    return tdist.recv(tensor, src=src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **_: Any) -> Any:
    return tdist.isend(tensor, dst=dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, **_: Any) -> Any:
    return tdist.irecv(tensor, src=src, group=group, tag=tag)


def gather(tensor: torch.Tensor, gather_list: list | None = None, dst: int = 0, group: Any = None,
           async_op: bool = False, **_: Any) -> Any:
    return tdist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: list | None = None, src: int = 0, group: Any = None,
            async_op: bool = False, **_: Any) -> Any:
    return tdist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True
