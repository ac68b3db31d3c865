"""shardwise: ZeRO data parallelism, offload and tensor parallelism on torch.distributed."""

from __future__ import annotations

from shardwise import comm, utils, zero
from shardwise.comm import RanksDivergedError, init_distributed
from shardwise.inference import init_inference
from shardwise.initialize import add_config_arguments, initialize

__all__ = ["initialize", "add_config_arguments", "init_inference", "init_distributed", "RanksDivergedError",
           "zero", "comm", "utils"]
__version__ = "0.1.0"
