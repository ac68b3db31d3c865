"""Which shard files a rank's load will read, known before it reads any (so they can be read together).

From the metadata alone: the files holding a segment that overlaps one of this rank's owned ranges
(every saved piece of a parameter resharded across TP degrees), and the files of the buffers and
frozen tensors it takes. Only a plan for ``ShardReader.prefetch``: a file it misses is still read,
by the streaming path, so a miss costs time, never correctness.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
