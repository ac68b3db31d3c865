"""``shardwise.config``: DeepSpeed's JSON config, read, checked and resolved once at the edge.

- ``read``: the file (JSON / hjson, duplicate keys refused) and ``timeout_of``.
- ``schema``: the pydantic models of every section, ``ConfigError``, ``SupportedFeatures``.
- ``keys``: the table of every DeepSpeed key (supported, accepted, refused) and the docs it generates.
- ``triage``: keys outside the schema: typo suggestions, unsupported-but-harmless notes.
- ``combinations``: ``check_combinations``, every refusal of a combination of parallelism degrees.
- ``load``: ``load_config``: normalize -> validate -> resolve ("auto", the batch rule).
"""

from __future__ import annotations

from shardwise.config.load import load_config
from shardwise.config.read import read_config, timeout_of
from shardwise.config.schema import (
    AUTO,
    BF16Config,
    ConfigError,
    FP16Config,
    FreeDict,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    SchedulerConfig,
    ShardwiseConfig,
    SupportedFeatures,
    TensorParallelConfig,
    TPSizeConfig,
    ZeroConfig,
)

__all__ = ["load_config", "read_config", "timeout_of", "AUTO", "BF16Config", "ConfigError", "FP16Config",
           "FreeDict", "OffloadOptimizerConfig", "OffloadParamConfig", "OptimizerConfig", "SchedulerConfig",
           "ShardwiseConfig", "SupportedFeatures", "TensorParallelConfig", "TPSizeConfig", "ZeroConfig"]
