"""What the checkpoint code reads from a training run: the engine, or ``shardwise.shard``'s adapter.

A structural type, so ``shardwise.checkpoint`` imports neither the engine nor the functional API
(no import cycle) and both write and read the same files.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

from shardwise.comm import Comm


class CheckpointTarget(Protocol):
    module: nn.Module
    groups: list  # trainable ShardedGroups, in the optimizer's order
    optimizer: Any  # a torch optimizer over the groups' masters, or None (evaluation only)
    lr_scheduler: Any
    loss_scaler: Any
    comm: Comm  # the shard group
    tp: Comm
    replica: Comm
    stage: int
    dp_world: int
    gas: int
    global_steps: int
    micro_steps: int
    skipped_steps: int

    def wait_for_params(self) -> None: ...
