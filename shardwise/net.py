"""Host networking helpers that need no torch (the launcher uses them before any rank starts)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on this host now (the OS picks it), for a single-node rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
