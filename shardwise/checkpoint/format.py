"""What every checkpoint file shares, below the readers, writers and validators that use it: the
format's name and version, :class:`CheckpointError`, and strict JSON reading.

Kept apart from ``fileio`` (which confines file names through ``validate``) so that ``validate``
and ``tp`` can raise and read without importing ``fileio`` back (no import cycle).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from shardwise.errors import OneLineError
from shardwise.files.safe import read_regular

FORMAT = "shardwise-checkpoint"
VERSION = 3  # 2: TP-sharded parameters saved per TP rank as NAME@tp{r}of{t}; 3: the "frozen" section
MAX_JSON = 1 << 30  # a larger JSON file in a checkpoint is damage


class CheckpointError(RuntimeError, OneLineError):
    """A checkpoint is missing, corrupt, truncated, or does not fit the engine it is loaded into."""


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def read_json(path: Path) -> Any:
    """Strict JSON (no NaN/Infinity, UTF-8), or a CheckpointError naming ``path``."""
    if not os.path.lexists(path):
        raise CheckpointError(f"{path}: file is missing")
    raw = read_regular(path, MAX_JSON, CheckpointError)  # a FIFO or folder is refused, never blocks
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: not valid JSON (truncated or corrupt): {e}"[:500]) from e
