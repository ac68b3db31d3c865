"""ZeRO: the sharded parameter group and what schedules it (see docs/architecture.md)."""

from shardwise.sharded_init.context import Init
from shardwise.zero.flat_group import ShardedGroup
from shardwise.zero.policy import ShardPolicy
from shardwise.zero.stage3.external import (
    ReleasedParameterError,
    register_external_parameter,
    unregister_external_parameter,
)
from shardwise.zero.stage3.gathered import GatheredParameters
from shardwise.zero.stage3.leaf import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
)
from shardwise.zero.unwrap import unwrap_model_for_generation

__all__ = ["GatheredParameters", "Init", "MiCS_Init", "ReleasedParameterError", "ShardedGroup", "ShardPolicy",
           "get_z3_leaf_modules", "register_external_parameter", "set_z3_leaf_modules",
           "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "unregister_external_parameter", "unset_z3_leaf_modules", "unwrap_model_for_generation",
           "z3_leaf_module"]

# DeepSpeed's MiCS_Init: the same deferred build; the sharding layout (zero_optimization.mics_shard_size,
# ZeRO inside groups of k ranks, replicas across) is applied by initialize from the config, as for Init.
MiCS_Init = Init
