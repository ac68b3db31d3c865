"""Host networking helpers that need no torch (the launcher uses them before any rank starts)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on this host now (the OS picks it), for a single-node rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def address_in_use(exc: BaseException) -> bool:
    """torch's ``DistNetworkError`` for a store that could not listen because its port is taken."""
    return type(exc).__name__ == "DistNetworkError" and "EADDRINUSE" in str(exc)


def port_taken(port: object, how: str) -> str:
    """The one-line explanation of a taken port, ending in ``how`` to pick another."""
    return f"port {port} is already in use on this host (another job, or one still shutting down); {how}"
