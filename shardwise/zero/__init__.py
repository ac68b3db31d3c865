"""ZeRO: the sharded parameter group and what schedules it (see docs/architecture.md)."""

from shardwise.zero.flat_group import ShardedGroup, ShardPolicy
from shardwise.zero.gathered import GatheredParameters
from shardwise.zero.init import Init

__all__ = ["GatheredParameters", "Init", "ShardedGroup", "ShardPolicy"]
