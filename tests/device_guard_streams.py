"""torch.cuda's and torch.accelerator's streams and events under the device guard (tests/device_guard.py):
served without a GPU build, so the library's own fences (``zero/host_copy.py``) run as on a GPU, and
an event's or a stream's ``synchronize()`` ends the non_blocking device-to-host copies recorded
before it (what the guard's ``HostReadBeforeSync`` waits for)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from device_guard import Guard


class GuardEvent:
    """torch.cuda.Event under the guard: ``synchronize()`` / ``wait()`` / ``query()`` end every
    in-flight copy recorded before it (conservative: a copy after the record is not covered)."""

    guard: Guard  # set on the class made for one guarded run

    def __init__(self, *a, **k):  # noqa: ARG002
        self.recorded: dict | None = None

    def record(self, stream=None) -> None:
        self.recorded = dict(self.guard.in_flight)
        # the device writes queued on ``stream`` so far (a side stream's copies): a wait for this event orders them
        self.side = [ref for ref, s in self.guard.on_side.items() if s is stream]

    def synchronize(self) -> None:
        self.guard.syncs += 1
        for ref in (self.recorded or {}):
            self.guard.in_flight.pop(ref, None)
        for ref in getattr(self, "side", []):
            self.guard.on_side.pop(ref, None)

    def query(self) -> bool:
        self.synchronize()
        return True

    def wait(self, stream=None) -> None:  # noqa: ARG002
        """A device-side wait: orders device work, frees no host read."""

    def elapsed_time(self, other) -> float:  # noqa: ARG002
        return 0.0


class GuardStream:
    """torch.cuda.Stream under the guard: a stream whose ``synchronize()`` ends every copy in flight."""

    guard: Guard

    def __init__(self, *a, **k):  # noqa: ARG002
        pass

    def synchronize(self) -> None:
        self.guard.syncs += 1
        self.guard.in_flight.clear()
        for ref in [r for r, s in self.guard.on_side.items() if s is self]:
            self.guard.on_side.pop(ref)

    def __enter__(self) -> GuardStream:
        """Work issued in the block is on this stream: a copy into a device tensor is marked as
        written on it (``guard.on_side``) until the compute stream waits for it."""
        self.guard.streams.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.guard.streams.pop()

    def wait_stream(self, other) -> None:
        """This stream waits for everything queued on ``other``: its writes are ordered for this one."""
        for ref in [r for r, s in self.guard.on_side.items() if s is other]:
            self.guard.on_side.pop(ref)

    def wait_event(self, event) -> None:
        """This stream waits for the writes recorded by ``event``."""
        for ref in getattr(event, "side", []):
            self.guard.on_side.pop(ref, None)

    def record_event(self, event: GuardEvent | None = None) -> GuardEvent:
        event = event or self.guard_event()
        event.record()
        return event

    def query(self) -> bool:
        self.synchronize()
        return True

    def guard_event(self) -> GuardEvent:
        return type("Event", (GuardEvent,), {"guard": self.guard})()


def stream_patches(guard: Guard, device: torch.device) -> list[tuple[object, str, object]]:
    """``torch.cuda``'s and ``torch.accelerator``'s stream and event names, served without a GPU
    build: ``device`` is the current accelerator, its streams and events end in-flight copies."""
    event = type("Event", (GuardEvent,), {"guard": guard})
    new_stream = type("Stream", (GuardStream,), {"guard": guard})
    stream = new_stream()
    guard.compute_stream = stream

    def synchronize(device=None) -> None:  # noqa: ARG001
        stream.synchronize()

    def current_stream(*a, **k) -> GuardStream:  # noqa: ARG001
        return stream

    def use_stream(s=None):  # noqa: ANN001, ANN202
        return contextlib.nullcontext(s) if s is None else s

    names = {"Event": event, "Stream": new_stream, "current_stream": current_stream,
             "default_stream": current_stream, "stream": use_stream, "synchronize": synchronize}
    acc = {"is_available": lambda: True, "current_accelerator": lambda *a, **k: torch.device(device.type),
           "current_stream": current_stream, "synchronize": synchronize, "device_count": lambda: 1,
           "current_device_index": lambda: device.index or 0}
    return ([(torch.cuda, k, v) for k, v in names.items()] + [(torch.accelerator, k, v) for k, v in acc.items()]
            + [(torch, "Event", event), (torch, "Stream", new_stream)])
