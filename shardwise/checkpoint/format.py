"""What every checkpoint file shares, below the readers, writers and validators that use it: the
format's name and version, with :class:`CheckpointError` and strict JSON reading handed on from
the leaves that define them (``shardwise.errors``, ``shardwise.files.safe``).

Kept apart from ``fileio`` (which confines file names through ``validate``) so that ``validate``
and ``tp`` can raise and read without importing ``fileio`` back (no import cycle).
"""

from __future__ import annotations

from shardwise.errors import CheckpointError
from shardwise.files.safe import read_json

__all__ = ["FORMAT", "VERSION", "CheckpointError", "read_json"]

FORMAT = "shardwise-checkpoint"
VERSION = 3  # 2: TP-sharded parameters saved per TP rank as NAME@tp{r}of{t}; 3: the "frozen" section
