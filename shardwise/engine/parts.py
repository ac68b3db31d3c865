"""What the engine's helpers read from the engine: :class:`EngineParts`, a Protocol.

``checks``, ``memory``, ``nonfinite`` and ``plain_backward`` each take the engine as their argument and read
a few of its attributes. Typed with :class:`~shardwise.engine.Engine` itself, each imported ``engine.py``
for the annotation alone, the very module that imports them: a loop inside ``engine/`` (through
``checks`` and ``compat`` six files long) in which no file could be read before the others. They name
this Protocol instead, so the helpers stand below ``engine.py``, which satisfies it by having these
attributes (``tests/test_package_layout.py`` holds that: every name here is one ``Engine`` has).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from shardwise.comm import Comm
    from shardwise.config.schema import ShardwiseConfig
    from shardwise.optim.loss_scale import DynamicLossScaler
    from shardwise.zero.builder import Sharding
    from shardwise.zero.flat_group import ShardedGroup
    from shardwise.zero.policy import ShardPolicy
    from shardwise.zero.stage3.fetcher import ParamFetcher


class EngineParts(Protocol):
    """The engine as its helpers see it: what it was built from, what it owns, where its step stands."""

    config: ShardwiseConfig
    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    loss_scaler: DynamicLossScaler | None
    # the sharding and what it built
    sharding: Sharding
    policy: ShardPolicy
    groups: list[ShardedGroup]
    unit_groups: list[list[ShardedGroup]]  # stage 3: the groups of each unit
    fetcher: ParamFetcher | None
    comm: Comm
    replica: Comm
    tp: Comm
    # where the step stands
    gas: int
    global_steps: int
    nonfinite_steps: int
    max_nonfinite_steps: int
    manual_scale_pending: bool
    _in_no_sync: bool
    _grads_reduced: bool

    def is_gradient_accumulation_boundary(self) -> bool: ...

    def zero_ignore_unused_parameters(self) -> bool: ...

    def wait_for_params(self) -> None: ...
