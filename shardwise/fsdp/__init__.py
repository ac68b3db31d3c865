"""``shardwise.fsdp``: ZeRO as a function, FSDP2-style (``shardwise.shard``), and the one construction path.

- ``module``: ``shard_module`` (place, TP-slice, cast, build; the engine uses it too), ``shard()``,
  :class:`ShardedModule`, ``sharding_of`` (the one accessor of a model's sharding).
- ``optim``: :class:`ShardedOptimizer` (any ``torch.optim`` optimizer on the shards), ``clip_grad_norm_``.
- ``state``: state dicts and checkpoints of a ``shard()``-ed model.
- ``unshard``: give a sharded model back its plain parameters (a second ``initialize``).
"""

from __future__ import annotations

from shardwise.fsdp.module import ShardedModule, is_sharded, shard, shard_module, sharding_of
from shardwise.fsdp.optim import ShardedOptimizer, clip_grad_norm_
from shardwise.fsdp.state import (
    full_state_dict,
    load_checkpoint,
    load_full_state_dict,
    load_sharded_state_dict,
    save_checkpoint,
    sharded_state_dict,
)
from shardwise.fsdp.unshard import unshard_module

__all__ = ["ShardedModule", "shard", "shard_module", "sharding_of", "ShardedOptimizer", "clip_grad_norm_",
           "full_state_dict", "load_full_state_dict", "sharded_state_dict", "load_sharded_state_dict",
           "save_checkpoint", "load_checkpoint", "is_sharded", "unshard_module"]
