"""What a pending collective reads from the :class:`~shardwise.comm.Comm` that started it: :class:`CommParts`.

A :class:`~shardwise.comm.work.Work` waits through its ``Comm``'s guard (a backend failure becomes the one
diverged-ranks error) and names its process group. Typed with ``Comm`` itself, ``work.py`` imported
``core.py`` (for the annotation alone), which imports ``work.py`` and ``gloo_exchange.py`` (whose methods
return works): a loop of three files in which none could be read first. ``work.py`` names this Protocol
instead, so it stands below ``core.py``, which satisfies it by having these members
(``tests/test_package_layout.py`` holds that: every name here is one ``Comm`` has).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class CommParts(Protocol):
    """The ``Comm`` as a work sees it: its process group (``None``: the default group) and its guard."""

    group: Any

    def _guard(self, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...
