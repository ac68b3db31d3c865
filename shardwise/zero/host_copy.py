"""Copies between an accelerator and the host that the host may read: the ordering rules in one place.

A device-to-host copy with ``non_blocking=True`` only *queues* the copy on the device's stream: the
call returns before the bytes have arrived, and a host read (an optimizer step on the CPU master, a
``mul_`` on the host tensor) may see whatever the buffer held before. The rules this module keeps:

1. a host tensor filled by a ``non_blocking`` device-to-host copy is read only after an event
   recorded on the copying stream *after* the copy has completed (``Event.synchronize``);
2. a tensor on the host reaches a device-only backend (NCCL) through a device copy, never as it is;
3. on the CPU (no accelerator, or a copy between host tensors) there is no stream and no event: the
   copy is synchronous and these functions reduce to a plain ``Tensor.to``.
"""

from __future__ import annotations

import torch

from shardwise.comm import Comm, compute_device


def accelerated(device: torch.device) -> bool:
    """Does ``device`` run on an accelerator this process drives (streams and events exist)?

    False on the CPU, and for a device type this build cannot run (a ``FakeTensorMode`` ``cuda``
    tensor on a CPU-only build: nothing is queued, so nothing needs a fence)."""
    if device.type == "cpu" or not torch.accelerator.is_available():
        return False
    acc = torch.accelerator.current_accelerator()
    return acc is not None and acc.type == device.type


def fence(device: torch.device) -> None:
    """Block the host until the work queued so far on ``device``'s current stream has finished
    (rule 1: an event recorded after the copy, synchronized before the host reads)."""
    if accelerated(device):
        event = torch.Event(device=device)
        event.record(torch.accelerator.current_stream(device))
        event.synchronize()


def to_readable(src: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``src`` on ``device`` in ``dtype``, safe for the host to read as soon as this returns.

    The copy is queued ``non_blocking`` (into pinned memory for a device-to-host copy) and fenced
    only when it leaves an accelerator for the host; device-side copies stay ordered on the stream."""
    out = src.to(device=device, dtype=dtype, non_blocking=True)
    if out.device.type == "cpu" and src.device.type != "cpu":
        fence(src.device)
    return out


def broadcast_through_device(comm: Comm, t: torch.Tensor, src: int = 0) -> None:
    """Broadcast ``t`` in place even where it lives on the host and the backend takes only device
    tensors (NCCL): a model not yet placed (expert slicing, ``GatheredParameters`` before
    ``initialize``) is broadcast through a copy on the collectives' device. Where ``t`` is there
    already (the CPU under gloo) it is broadcast as it is: nothing is copied."""
    buf = t.to(compute_device())
    comm.broadcast(buf, src=src)
    if buf is not t:
        t.copy_(buf)
