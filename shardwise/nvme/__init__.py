"""ZeRO-Infinity's NVMe tier: optimizer states in swap files, stepped group by group, and stage-3
parameter shards in swap files, read at every gather (docs/offload.md).

Built on ``shardwise.aio`` (the I/O engine); the engine reads the config and hands
:class:`NvmeSettings` down (``zero/`` never reads the config)."""

from shardwise.nvme.folder import SwapFolder, check_room
from shardwise.nvme.param_store import NvmeParamStore, ParamSwap
from shardwise.nvme.pieces import is_stand_in
from shardwise.nvme.swap_file import SwapFileError
from shardwise.nvme.swapper import NvmeSettings, OptimizerSwapper

__all__ = ["NvmeParamStore", "NvmeSettings", "OptimizerSwapper", "ParamSwap", "SwapFileError", "SwapFolder",
           "check_room", "is_stand_in"]
