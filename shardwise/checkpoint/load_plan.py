"""Which shard files a rank's load will read, known before it reads any, so they are hashed together.

From the metadata alone: the files holding a segment that overlaps one of this rank's owned ranges
(every saved piece of a parameter resharded across TP degrees), and the files of the buffers and
frozen tensors it takes. Only a plan for ``ShardReader.verify_ahead`` (``hash_ahead.py``): a file
it misses is verified when first read, as before, so a miss costs time, never correctness.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from shardwise.checkpoint.experts import saved_offset
from shardwise.checkpoint.frozen import saved_extras
from shardwise.checkpoint.tp import direct_key, saved_index, spec_of

if TYPE_CHECKING:
    from shardwise.checkpoint.target import CheckpointTarget


def _entry_files(info: dict, lo: int | None = None, hi: int | None = None) -> list[str]:
    if "segments" not in info:
        return [info["file"]] if info.get("file") else []
    return [s["file"] for s in info["segments"] if lo is None or (s["start"] < hi and lo < s["stop"])]


def needed_files(engine: CheckpointTarget, meta: dict, skip: set[str], module: bool = True) -> list[str]:
    """The files this rank's load reads, in first-use order (``skip``: names it keeps live values for)."""
    tensors, out = meta["tensors"], []
    index = saved_index(tensors)
    for g in engine.groups:
        for seg in g.owned:
            name, p = g.names[seg.index], g.params[seg.index]
            if name in skip or name not in index:
                continue
            key = direct_key(name, spec_of(p), tensors)
            if key is None:  # rebuilt from its TP pieces: all of them
                out += [f for k in index[name] for f in _entry_files(tensors[k])]
            else:
                off = saved_offset(p)
                out += _entry_files(tensors[key], seg.start + off, seg.stop + off)
    if module:
        out += [f for info in saved_extras(meta).values() for f in _entry_files(info)]
    return list(dict.fromkeys(out))


AHEAD = True  # False: every file verified when first read, on the loading thread (the benchmark's baseline)


@contextmanager
def hashed_ahead(engine: CheckpointTarget, meta: dict, reader: Any) -> Iterator[None]:
    """The body runs while this rank's files are hashed in the background; on leaving, every hash is
    checked (a mismatch raised naming its file, in place of whatever the body raised after reading
    a corrupt file). A foreign checkpoint's reader, which holds its tensors already, is left alone."""
    if not AHEAD or not hasattr(reader, "verify_ahead"):
        yield
        return
    try:
        files = needed_files(engine, meta, set())
    except (KeyError, TypeError, ValueError, IndexError):
        files = []  # the loader reports what is wrong with the metadata, naming it
    try:
        reader.verify_ahead(files)
        yield
    finally:
        reader.wait_verified()
