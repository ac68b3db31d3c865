"""zero.Init's reader of a ``from_pretrained`` folder: each rank reads only the element ranges it needs.

Split from ``sharded_init/context.py`` (which re-exports both names, ``weight_map`` from ``files/model_folder.py``):
the source that serves a parameter's range by its own name, a tied alias, or the stored tensors
transformers converts into it (``sharded_init/hub_names.py``).
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
from torch import nn

from shardwise.errors import UserError
from shardwise.files.model_folder import weight_map
from shardwise.files.safetensors_io import SafetensorsFile
from shardwise.sharded_init.hub_names import StoredRows, folder_of, hub_names


class SafetensorsSource:
    """zero.Init's view of an HF safetensors folder: a parameter's name (or a tied alias) -> file.

    The index is confined to the folder (:func:`weight_map`); files are opened on first use by the
    one reader (:class:`~shardwise.files.safetensors_io.SafetensorsFile`, header validated), and each
    rank reads exactly the element ranges of its shards (``bytes_read`` shows it). Given the
    ``model``, a name the folder stores otherwise (the hub's per-expert MoE layout that
    ``save_pretrained`` writes) is read from the stored tensors transformers would convert
    (:mod:`shardwise.sharded_init.hub_names`).
    """

    def __init__(self, folder: Path, model: nn.Module | None = None):
        self.files = weight_map(folder)
        self._open: dict[Path, SafetensorsFile] = {}
        self._model = weakref.ref(model) if model is not None else None
        self._hub: dict[str, StoredRows] | None = None

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self._open.values())

    def _file(self, key: str) -> SafetensorsFile:
        path = self.files[key]
        if path not in self._open:
            self._open[path] = SafetensorsFile(path)
        return self._open[path]

    def _stored(self, name: str, aliases: list[str]) -> tuple[str, StoredRows | None]:
        """The name to read (the parameter's own, an alias, or a converted one) and its rows if converted."""
        for n in [name, *aliases]:
            if n in self.files:
                return n, None
        model = self._model() if self._model is not None else None
        if self._hub is None and model is not None:
            self._hub = hub_names(model, list(self.files))
        for n in [name, *aliases]:
            if n in (self._hub or {}):
                rows = self._hub[n]
                if rows.problem:
                    raise UserError(f"{folder_of(self.files)}: cannot read the model's tensor {n!r}: {rows.problem}")
                return n, rows
        raise UserError(f"{folder_of(self.files)}: the model's tensor {name!r} is not in the checkpoint"
                        + (" (nor under the names transformers converts for this model)" if model is not None else ""))

    def read(self, name: str, shape: torch.Size, start: int, end: int, aliases: list[str]) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor ``name``, refused unless it is stored with
        the parameter's ``shape`` (else the elements would belong to other rows: silent garbage)."""
        key, rows = self._stored(name, aliases)
        if rows is not None and rows.stacked:
            return self._read_rows(key, rows, shape, start, end)
        key = rows.rows[0][0] if rows is not None else key
        f = self._file(key)
        stored = f.info(key).shape
        if stored != tuple(shape):
            raise ValueError(f"{f.path}: tensor {key!r} is stored with shape {list(stored)} but the model's "
                             f"parameter {name} has shape {list(shape)}: config and weights do not match")
        return f.read(key, start, end)

    def _read_rows(self, name: str, rows: StoredRows, shape: torch.Size, start: int, end: int) -> torch.Tensor:
        """A converted tensor's range: row ``e`` is its stored tensors flattened one after another,
        so the range is a few contiguous ranges of stored tensors, read as they are."""
        infos = [[self._file(k).info(k) for k in row] for row in rows.rows]
        per = [sum(i.numel for i in row) for row in infos]
        inner = [i.shape[1:] for row in infos for i in row]
        want_rows = sum(i.shape[0] for i in infos[0])
        if (len(rows.rows) != shape[0] or len(set(per)) != 1 or len(set(inner)) != 1
                or (len(rows.rows), want_rows, *inner[0]) != tuple(shape)):
            raise ValueError(f"{folder_of(self.files)}: the tensors {list(rows.rows[0])} ... stored for the model's "
                             f"{name!r} do not make its shape {list(shape)}: config and weights do not match")
        out = torch.empty(end - start, dtype=infos[0][0].dtype)
        at = 0
        for e in range(start // per[0], -(-end // per[0])):
            base = e * per[0]
            for key, info in zip(rows.rows[e], infos[e], strict=True):
                lo, hi = max(start - base, 0), min(end - base, info.numel)
                if lo < hi:
                    self._file(key).read(key, lo, hi, out=out[at:at + hi - lo])
                    at += hi - lo
                base += info.numel
        return out
