"""What the direct-call hooks and the released-use check read from the fetcher: :class:`FetcherParts`.

:class:`~shardwise.zero.stage3.fetcher.ParamFetcher` builds a ``DirectCalls`` (``direct_calls.py``) and a
``ReleasedUseCheck`` (``external.py``) and hands itself to each; they read its units, its running stack and
a few of its methods. Typed with ``ParamFetcher`` itself, both imported ``fetcher.py`` (for the annotation
alone), the module that imports them: a loop of three files in which none could be read first. They name
this Protocol instead, so they stand below the fetcher, which satisfies it by having these members
(``tests/test_package_layout.py`` holds that: every name here is one ``ParamFetcher`` has).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import nn

    from shardwise.zero.flat_group import ShardedGroup


class FetcherParts(Protocol):
    """The fetcher as its helpers see it: the units and their groups, and which forward runs now."""

    units: list[nn.Module]  # the decoder layers (or other units), the root last
    groups: list[list[ShardedGroup]]  # each unit's own groups
    root: int
    unit_of_module: dict[int, int]
    unit_of_group: dict[int, int]
    unit_names: list[str]
    stack: list[int]  # units whose forward is running, innermost last
    trace: list[int]
    all_gathered: bool
    on_backward: Callable[[], None] | None

    def begin_trace(self) -> None: ...

    def groups_of(self, ui: int) -> list[ShardedGroup]: ...

    def measure(self) -> None: ...

    def running_name(self) -> str: ...

    def on_access(self, group: ShardedGroup, module: nn.Module | None = None) -> None: ...

    def forget_external(self, group: ShardedGroup) -> None: ...
