"""The one place a rank's shard file is written: plain buffered writes, sha256 on the way, fsync.

A seam on purpose: the synchronous save and the background writer (``checkpoint/async_save.py``)
both call :func:`write_shard`, so a faster file engine (``shardwise/aio``'s ``pwritev`` /
``O_DIRECT`` thread engine, when it lands) replaces this body alone and both paths get it; the
sha256 and the byte count it returns are what ``metadata.json`` records, whoever writes.

:func:`at_phase` is a test seam: the crash-consistency tests replace it to SIGKILL a rank when a
save reaches a phase (``staging``, ``writing``, ``fsync``, ``publishing``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardwise.checkpoint.fileio import SafetensorsWriter

PHASES = ("staging", "writing", "fsync", "publishing")


def at_phase(phase: str) -> None:
    """Test seam, called when a save reaches ``phase`` (one of :data:`PHASES`); does nothing."""


def write_shard(path: Path, pieces: list[tuple[str, torch.Tensor]]) -> tuple[str, int]:
    """One safetensors file of ``pieces`` (host tensors that nothing overwrites meanwhile), flushed
    and fsynced; returns (sha256 hex, size in bytes)."""
    w = SafetensorsWriter(path, [(k, t.dtype, tuple(t.shape)) for k, t in pieces])
    for i, (k, t) in enumerate(pieces):
        w.write(k, t)
        if i == 0:
            at_phase("writing")
    at_phase("fsync")
    return w.close()
