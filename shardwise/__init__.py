"""shardwise: ZeRO data parallelism, offload and tensor parallelism on torch.distributed."""

from __future__ import annotations

from shardwise import comm, utils, zero
from shardwise.comm import RanksDivergedError, init_distributed
from shardwise.config.schema import ConfigError as DeepSpeedConfigError
from shardwise.deepspeed import install_as_deepspeed
from shardwise.engine.initialize import add_config_arguments, initialize
from shardwise.fsdp.compiled import compile  # noqa: A004
from shardwise.fsdp.module import ShardedModule, shard
from shardwise.fsdp.optim import ShardedOptimizer, clip_grad_norm_
from shardwise.fsdp.state import (
    full_state_dict,
    load_checkpoint,
    load_full_state_dict,
    load_sharded_state_dict,
    save_checkpoint,
    sharded_state_dict,
)
from shardwise.inference.compat import init_inference
from shardwise.zero import GatheredParameters

__all__ = ["initialize", "add_config_arguments", "init_inference", "init_distributed", "RanksDivergedError",
           "zero", "comm", "utils", "shard", "ShardedModule", "ShardedOptimizer", "clip_grad_norm_",
           "GatheredParameters", "full_state_dict", "load_full_state_dict", "sharded_state_dict",
           "load_sharded_state_dict", "save_checkpoint", "load_checkpoint", "DeepSpeedConfigError",
           "install_as_deepspeed", "compile"]
__version__ = "0.1.0"
# DeepSpeed exposes these; scripts print or compare them (no git metadata is baked into a source tree).
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in __version__.split("."))
__git_hash__ = "unknown"
__git_branch__ = "unknown"
