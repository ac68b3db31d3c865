"""`shardwise train`: the main job (options, model, data, loop, outputs); see docs/train.md."""

from shardwise.train.run import main

__all__ = ["main"]
