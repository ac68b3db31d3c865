"""``shardwise.engine``: DeepSpeed's engine around one sharding (``shardwise.initialize`` builds it).

- ``engine``: :class:`Engine`: config -> ``shard_module`` -> forward / backward / step, loss scaling.
- ``compat``: the DeepSpeed-named accessors and delegates scripts call on an engine; ``UsageError``.
- ``checks``: DeepSpeed's checks on how an engine is used (unused parameters, checkpoint tags).
- ``initialize``: ``initialize()`` and ``add_config_arguments()`` (exported as ``shardwise.initialize``;
  not re-exported here, so ``shardwise.engine.initialize`` stays the module).
- ``nonfinite``: a non-finite gradient norm without an fp16 loss scaler: ``NonFiniteError``, or a skip
  within ``shardwise.max_nonfinite_steps``.
- ``mpu``: a Megatron-style ``mpu`` object turned into shardwise's mesh.
"""

from __future__ import annotations

from shardwise.engine.compat import EngineAccessors, UsageError
from shardwise.engine.engine import Engine
from shardwise.engine.nonfinite import NonFiniteError

__all__ = ["Engine", "EngineAccessors", "NonFiniteError", "UsageError"]
