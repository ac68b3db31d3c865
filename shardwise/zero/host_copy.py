"""Copies between an accelerator and the host that the host may read: the ordering rules in one place.

A device-to-host copy with ``non_blocking=True`` only *queues* the copy on a stream: the call returns
before the bytes have arrived, and a host read (an optimizer step on the CPU master, a ``mul_`` on
the host tensor) may see whatever the buffer held before. Likewise a host-to-device copy from
pinned memory still reads the host buffer after the call returns. The rules this module keeps:

1. a host tensor filled by a ``non_blocking`` device-to-host copy is read only after an event
   recorded on the copying stream *after* the copy (``Event.synchronize`` on the host);
2. a side stream first waits for the compute stream (``wait_stream``), so it copies the gradient
   the backward and its reductions left, not an earlier one;
3. the source of a side-stream copy stays referenced until its event is synchronized (the caching
   allocator would otherwise hand its memory to the compute stream while the copy still reads it);
4. a pinned host buffer is not written by the host while a ``non_blocking`` copy out of it may be
   pending: an event recorded on the compute stream after that copy is synchronized first;
5. a tensor on the host reaches a device-only backend (NCCL) through a device copy, never as it is
   (``comm/host.py``, ``broadcast_through_device``);
6. on the CPU (no accelerator, or a copy between host tensors) there is no stream and no event:
   every function reduces to the plain copy, so the CPU path is today's code, bit for bit.
"""

from __future__ import annotations

import torch

_SIDE_STREAMS: dict[torch.device, torch.Stream] = {}


def accelerated(device: torch.device) -> bool:
    """Does ``device`` run on an accelerator this process drives (streams and events exist)?

    False on the CPU, and for a device type this build cannot run (a ``FakeTensorMode`` ``cuda``
    tensor on a CPU-only build: nothing is queued, so nothing needs a fence)."""
    if device.type == "cpu" or not torch.accelerator.is_available():
        return False
    acc = torch.accelerator.current_accelerator()
    return acc is not None and acc.type == device.type


def recorded(device: torch.device, stream: torch.Stream | None = None) -> torch.Event | None:
    """An event recorded now on ``stream`` (default: ``device``'s current stream); None off an accelerator."""
    if not accelerated(device):
        return None
    event = torch.Event(device=device)
    event.record(stream if stream is not None else torch.accelerator.current_stream(device))
    return event


def fence(device: torch.device, copies_too: bool = False) -> None:
    """Block the host until the work queued so far on ``device``'s current stream has finished
    (rule 1: an event recorded after the copy, synchronized before the host reads); ``copies_too``:
    and the side copy stream's (a prefetch out of a pinned shard the host is about to write: rule 4)."""
    event = recorded(device)
    if event is not None:
        event.synchronize()
        side = _SIDE_STREAMS.get(device) if copies_too and device.index is not None else None
        if side is not None:
            side.synchronize()


def to_readable(src: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``src`` on ``device`` in ``dtype``, safe for the host to read as soon as this returns.

    The copy is queued ``non_blocking`` (into pinned memory for a device-to-host copy) and fenced
    only when it leaves an accelerator for the host; device-side copies stay ordered on the stream."""
    out = src.to(device=device, dtype=dtype, non_blocking=True)
    if out.device.type == "cpu" and src.device.type != "cpu":
        fence(src.device)
    return out


def side_stream(device: torch.device) -> torch.Stream:
    """One copy stream per device, shared by every group (copies queue behind each other on it,
    as they would on one DMA engine, and the compute stream stays free for the next kernels)."""
    if device.index is None:
        device = torch.device(device.type, torch.accelerator.current_device_index())
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.Stream(device=device)
    return _SIDE_STREAMS[device]


class CopyAhead:
    """A host-to-device copy queued on the side stream; ``wait()`` makes the compute stream wait
    for its event (device-side: the host does not block)."""

    def __init__(self, device: torch.device, event: torch.Event):
        self.device, self.event = device, event

    def wait(self) -> None:
        torch.accelerator.current_stream(self.device).wait_event(self.event)


def copy_ahead(dst: torch.Tensor, src: torch.Tensor) -> CopyAhead | None:
    """``dst.copy_(src)`` from host memory into a device buffer, for a prefetch: queued on the side
    copy stream, so it overlaps the kernels the compute stream runs meanwhile (one stream would run
    them one after the other). The copy stream first waits for the compute stream, whose queued
    kernels may still read ``dst`` (a pool buffer given back by the last layer that used it). Off an
    accelerator the plain copy (None): the CPU path is unchanged, bit for bit."""
    if src.device.type != "cpu" or not accelerated(dst.device):
        dst.copy_(src, non_blocking=True)
        return None
    stream = side_stream(dst.device)
    stream.wait_stream(torch.accelerator.current_stream(dst.device))
    with stream:
        dst.copy_(src, non_blocking=True)
        event = recorded(dst.device, stream)
    return CopyAhead(dst.device, event)


class GradToHost:
    """Offload on an accelerator: one group's owned gradient into a persistent host buffer.

    ``start`` queues the copy on the side stream (after the compute stream's work: rule 2) and
    returns at once, so every group's copy is in flight before the host waits for the first;
    ``wait`` synchronizes the copy's event (rule 1) and hands the buffer to the host. The buffer is
    the master's gradient (``master.grad``) until the next ``start``, which the host issues only
    after the optimizer step that read it has returned. ``published`` / ``master_writable`` keep
    rule 4 for the master the step copies back to the device from.
    """

    def __init__(self, device: torch.device, numel: int, dtype: torch.dtype, pin_memory: bool):
        """``pin_memory``: a pinned buffer (the copy is asynchronous; pageable memory makes the
        driver copy synchronously, still correct)."""
        self.device = device
        self.buffer = torch.empty(numel, dtype=dtype, pin_memory=pin_memory and accelerated(device))
        self._copied: torch.Event | None = None
        self._source: torch.Tensor | None = None  # rule 3
        self._published: torch.Event | None = None

    @property
    def pending(self) -> bool:
        return self._copied is not None

    def start(self, src: torch.Tensor) -> None:
        """Queue ``src`` (on ``device``) into the host buffer, converted to its dtype on the device."""
        stream = side_stream(self.device)
        stream.wait_stream(torch.accelerator.current_stream(self.device))
        with stream:
            staged = src if src.dtype == self.buffer.dtype else src.to(self.buffer.dtype)
            self.buffer.copy_(staged, non_blocking=True)
            self._copied = recorded(self.device, stream)
        self._source = staged

    def wait(self) -> torch.Tensor:
        """The host buffer, its copy finished."""
        if self._copied is not None:
            self._copied.synchronize()
        self._copied, self._source = None, None
        return self.buffer

    def published(self) -> None:
        """The compute stream has been given a ``non_blocking`` copy out of the (pinned) master."""
        self._published = recorded(self.device)

    def master_writable(self) -> None:
        """Before the host writes the master in place: that copy has read it (rule 4)."""
        if self._published is not None:
            self._published.synchronize()
            self._published = None
