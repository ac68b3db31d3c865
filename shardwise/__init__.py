"""shardwise: ZeRO data parallelism, offload and tensor parallelism on torch.distributed."""

from __future__ import annotations

from shardwise import zero
from shardwise.comm import RanksDivergedError, init_distributed
from shardwise.inference import init_inference
from shardwise.initialize import initialize

__all__ = ["initialize", "init_inference", "init_distributed", "RanksDivergedError", "zero"]
__version__ = "0.1.0"
