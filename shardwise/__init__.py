"""shardwise: ZeRO data parallelism, offload and tensor parallelism on torch.distributed."""

from __future__ import annotations

from shardwise import comm, utils, zero
from shardwise.comm import RanksDivergedError, init_distributed
from shardwise.config_schema import ConfigError as DeepSpeedConfigError
from shardwise.inference import init_inference
from shardwise.initialize import add_config_arguments, initialize

__all__ = ["initialize", "add_config_arguments", "init_inference", "init_distributed", "RanksDivergedError",
           "DeepSpeedConfigError",
           "zero", "comm", "utils"]
__version__ = "0.1.0"
# DeepSpeed exposes these; scripts print or compare them (no git metadata is baked into a source tree).
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in __version__.split("."))
__git_hash__ = "unknown"
__git_branch__ = "unknown"
