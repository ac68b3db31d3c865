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

    def record(self, stream=None) -> None:  # noqa: ARG002
        self.recorded = dict(self.guard.in_flight)

    def synchronize(self) -> None:
        self.guard.syncs += 1
        for ref in (self.recorded or {}):
            self.guard.in_flight.pop(ref, None)

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

    def __enter__(self) -> GuardStream:
        return self

    def __exit__(self, *exc: object) -> None:
        """Work issued in the block is on this stream: the guard tracks copies, not streams."""

    def wait_stream(self, other) -> None:  # noqa: ARG002
        """Device-side ordering only."""

    def wait_event(self, event) -> None:  # noqa: ARG002
        """Device-side ordering only."""

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

    def synchronize(device=None) -> None:  # noqa: ARG001
        stream.synchronize()

    def current_stream(*a, **k) -> GuardStream:  # noqa: ARG001
        return stream

    def use_stream(s=None):  # noqa: ANN001, ANN202
        return contextlib.nullcontext(s)

    names = {"Event": event, "Stream": new_stream, "current_stream": current_stream,
             "default_stream": current_stream, "stream": use_stream, "synchronize": synchronize}
    acc = {"is_available": lambda: True, "current_accelerator": lambda *a, **k: torch.device(device.type),
           "current_stream": current_stream, "synchronize": synchronize, "device_count": lambda: 1,
           "current_device_index": lambda: device.index or 0}
    return ([(torch.cuda, k, v) for k, v in names.items()] + [(torch.accelerator, k, v) for k, v in acc.items()]
            + [(torch, "Event", event), (torch, "Stream", new_stream)])
