"""shardwise: ZeRO data parallelism, offload and tensor parallelism on torch.distributed.

The public names load on first use (PEP 562), so ``shardwise launch`` and ``shardwise --help``
start without importing torch: the launcher only builds a torchrun command line, and importing
torch there cost every launch about 4 s before its ranks even started.
"""

from __future__ import annotations

import importlib as _importlib
import importlib.util as _importlib_util
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

# public name -> (module, attribute in it; None: the module itself)
_PUBLIC: dict[str, tuple[str, str | None]] = {
    "comm": ("shardwise.comm", None),
    "utils": ("shardwise.utils", None),
    "zero": ("shardwise.zero", None),
    "mesh": ("shardwise.mesh", None),  # the old path of the rank grid (shardwise/mesh.py hands on layout/)
    "init_distributed": ("shardwise.comm", "init_distributed"),
    "RanksDivergedError": ("shardwise.comm", "RanksDivergedError"),
    "DeepSpeedConfigError": ("shardwise.config.schema", "ConfigError"),
    "install_as_deepspeed": ("shardwise.deepspeed", "install_as_deepspeed"),
    "initialize": ("shardwise.pipeline.entry", "initialize"),  # the engine's, with pipeline.stages
    "add_config_arguments": ("shardwise.engine.initialize", "add_config_arguments"),
    "compile": ("shardwise.fsdp.compiled", "compile"),
    "ShardedModule": ("shardwise.fsdp.module", "ShardedModule"),
    "shard": ("shardwise.fsdp.module", "shard"),
    "ShardedOptimizer": ("shardwise.fsdp.optim", "ShardedOptimizer"),
    "clip_grad_norm_": ("shardwise.fsdp.optim", "clip_grad_norm_"),
    "full_state_dict": ("shardwise.fsdp.state", "full_state_dict"),
    "load_checkpoint": ("shardwise.fsdp.state", "load_checkpoint"),
    "load_full_state_dict": ("shardwise.fsdp.state", "load_full_state_dict"),
    "load_sharded_state_dict": ("shardwise.fsdp.state", "load_sharded_state_dict"),
    "save_checkpoint": ("shardwise.fsdp.state", "save_checkpoint"),
    "sharded_state_dict": ("shardwise.fsdp.state", "sharded_state_dict"),
    "init_inference": ("shardwise.inference.compat", "init_inference"),
    "GatheredParameters": ("shardwise.zero", "GatheredParameters"),
}

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


def __getattr__(name: str) -> _Any:
    """A public name, or a subpackage (``shardwise.layout``, ``shardwise.checkpoint``, ... as an eager
    ``import shardwise`` used to leave them), imported now."""
    if name in _PUBLIC:
        module, attr = _PUBLIC[name]
    elif not name.startswith("_") and _importlib_util.find_spec(f"{__name__}.{name}") is not None:
        module, attr = f"{__name__}.{name}", None
    else:
        raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
    value = _importlib.import_module(module)
    value = value if attr is None else getattr(value, attr)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({n for n in globals() if not n.startswith("_") or n.startswith("__")} | set(_PUBLIC))


if _TYPE_CHECKING:  # the names as type checkers and editors see them
    from shardwise import comm, utils, zero  # noqa: F401
    from shardwise.comm import RanksDivergedError, init_distributed  # noqa: F401
    from shardwise.config.schema import ConfigError as DeepSpeedConfigError  # noqa: F401
    from shardwise.deepspeed import install_as_deepspeed  # noqa: F401
    from shardwise.engine.initialize import add_config_arguments  # noqa: F401
    from shardwise.fsdp.compiled import compile  # noqa: A004, F401
    from shardwise.fsdp.module import ShardedModule, shard  # noqa: F401
    from shardwise.fsdp.optim import ShardedOptimizer, clip_grad_norm_  # noqa: F401
    from shardwise.fsdp.state import (  # noqa: F401
        full_state_dict,
        load_checkpoint,
        load_full_state_dict,
        load_sharded_state_dict,
        save_checkpoint,
        sharded_state_dict,
    )
    from shardwise.inference.compat import init_inference  # noqa: F401
    from shardwise.pipeline.entry import initialize  # noqa: F401
    from shardwise.zero import GatheredParameters  # noqa: F401
