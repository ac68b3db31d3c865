"""Checks on everything a checkpoint folder says about itself, before any of it is used.

A checkpoint is input: it may be damaged, edited or hostile. Three rules:

- every path read from a file (shard lists, ``latest``, index ``weight_map`` entries) must name a
  file inside its folder (:func:`confined_path`);
- ``metadata.json`` must match the :class:`Metadata` schema (types, ranges, dtype allow-lists,
  segments that tile each tensor, byte counts the shard files can hold), so that later code may
  index it freely;
- JSON state that is handed to torch objects (optimizer param groups, LR scheduler, loss scaler)
  must have the same JSON shape as the live object's own state (:func:`match_like`).

Every refusal is a :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from shardwise.checkpoint.format import FORMAT, VERSION, CheckpointError
from shardwise.files.safe import confine
from shardwise.files.safetensors_io import dtype_from_name

MAX_NUMEL = 2**40  # elements in one tensor: larger is a damaged header, not a model
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")  # optimizer state / trained tensors
ANY_DTYPES = (*FLOAT_DTYPES, "int64", "int32", "int16", "int8", "uint8", "bool")  # buffers too

Count = Annotated[StrictInt, Field(ge=0, le=MAX_NUMEL)]
Positive = Annotated[StrictInt, Field(ge=1, le=MAX_NUMEL)]
Shape = Annotated[list[Count], Field(max_length=8)]
Name = Annotated[StrictStr, Field(min_length=1, max_length=4096)]
FloatDtype = Literal[FLOAT_DTYPES]  # type: ignore[valid-type]
AnyDtype = Literal[ANY_DTYPES]  # type: ignore[valid-type]


def confined_path(folder: str | Path, name: object, source: str | Path) -> Path:
    """``folder/name`` resolved, refused unless it stays inside ``folder`` (``files.safe.confine``).

    ``name`` was read from ``source`` (named in the error): an absolute path, a ``..`` part, a
    backslash or a symlink leading out of ``folder`` is refused, so a checkpoint can never make
    shardwise open (or hash) a file elsewhere.
    """
    return confine(folder, name, source, CheckpointError)


def _numel(shape: list[int]) -> int:
    return math.prod(shape) if shape else 1


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=dtype_from_name(dtype)).element_size()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Segment(_Strict):
    file: Name
    start: Count
    stop: Count


class TpInfo(_Strict):
    param: Name
    dim: Annotated[StrictInt, Field(ge=0, le=7)]
    full: Positive
    size: Annotated[StrictInt, Field(ge=1, le=65536)]
    rank: Count
    parts: Annotated[StrictInt, Field(ge=1, le=64)]
    full_shape: Shape

    @model_validator(mode="after")
    def _consistent(self) -> TpInfo:
        if self.rank >= self.size or self.dim >= len(self.full_shape) or self.full_shape[self.dim] != self.full:
            raise ValueError(f"TP split {self.model_dump()} is inconsistent (rank < size, "
                             "full_shape[dim] == full)")
        if self.parts > 1 and self.full % (self.parts * self.size):
            raise ValueError(f"TP split of {self.full} rows into {self.parts} parts x {self.size} ranks")
        return self

    def local_extent(self) -> int:
        if self.parts > 1:
            return self.full // self.size
        return -(-self.full // self.size)


def _check_tp(tp: TpInfo | None, shape: list[int]) -> None:
    if tp is None:
        return
    want = list(tp.full_shape)
    want[tp.dim] = tp.local_extent()
    if want != shape:
        raise ValueError(f"local shape {shape} does not fit its TP split (expected {want})")


class TensorInfo(_Strict):
    shape: Shape
    numel: Count
    dtype: FloatDtype
    tp: TpInfo | None = None
    segments: list[Segment]

    @model_validator(mode="after")
    def _tiles(self) -> TensorInfo:
        if _numel(self.shape) != self.numel:
            raise ValueError(f"numel {self.numel} is not the product of shape {self.shape}")
        _check_tp(self.tp, self.shape)
        pos = 0
        for s in self.segments:  # sorted, no gap, no overlap, nothing empty, ends at numel
            if s.start != pos or s.stop <= s.start:
                raise ValueError(f"segments must tile [0, {self.numel}) in order: got [{s.start}, {s.stop}) "
                                 f"where {pos} was expected")
            pos = s.stop
        if pos != self.numel:
            raise ValueError(f"segments cover {pos} of {self.numel} elements")
        return self


class FrozenInfo(TensorInfo):
    """A frozen parameter: segments like a trained tensor, in its own dtype (checkpoint/frozen.py)."""

    dtype: AnyDtype


class ModuleInfo(_Strict):
    shape: Shape
    dtype: AnyDtype
    tp: TpInfo | None = None
    file: Name

    @model_validator(mode="after")
    def _fits(self) -> ModuleInfo:
        if _numel(self.shape) > MAX_NUMEL:
            raise ValueError(f"shape {self.shape} is too large")
        _check_tp(self.tp, self.shape)
        return self


class Scalar(_Strict):
    value: StrictBool | StrictInt | StrictFloat
    dtype: AnyDtype | None

    @model_validator(mode="after")
    def _finite(self) -> Scalar:
        if not math.isfinite(self.value):
            raise ValueError(f"optimizer scalar {self.value} is not finite")
        return self


class FileInfo(_Strict):
    sha256: Annotated[StrictStr, Field(pattern=r"^[0-9a-f]{64}$")]
    bytes: Annotated[StrictInt, Field(ge=8, le=2**50)]


class Layout(_Strict):
    world: Positive
    dp: Positive
    tp: Positive = 1
    stage: Annotated[StrictInt, Field(ge=0, le=3)]
    compute_dtype: FloatDtype | None = None


class Counters(_Strict):
    global_steps: Count
    micro_steps: Count
    skipped_steps: Count


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    format: Literal[FORMAT]  # type: ignore[valid-type]
    version: Annotated[StrictInt, Field(ge=1, le=VERSION)]
    layout: Layout
    order: list[Name]
    tensors: dict[Name, TensorInfo]
    states: list[Name]
    state_dtypes: dict[Name, FloatDtype]
    master_dtype: FloatDtype = "float32"  # bf16/fp16 with DeepSpeed's low-precision master keys
    scalars: dict[Name, dict[Name, Scalar]]
    module: dict[Name, ModuleInfo]
    frozen: dict[Name, FrozenInfo] = {}  # format 3: frozen parameters (format 2 kept them in 'module')
    excluded_frozen: list[Name] = []  # frozen parameters left out by exclude_frozen_parameters=True
    files: dict[Name, FileInfo]
    param_groups: list[dict[Name, Any]]
    lr_scheduler: dict[Name, Any] | None
    loss_scaler: dict[Name, Any] | None
    counters: Counters
    rng: list[dict[Name, Any]]
    client_state: Any = None
    has_model_config: StrictBool = False
    tied: dict[Name, Name] = {}  # alias -> saved name of a shared parameter (absent before v0.1 checkpoints)
    whole_tensor_state: dict[Name, Any] | None = None  # whole-tensor optimizers: checkpoint/whole_tensor_state.py

    @model_validator(mode="after")
    def _cross(self) -> Metadata:
        from shardwise.checkpoint.tp import check_pieces, saved_index

        if sorted(self.states) != sorted(self.state_dtypes) or len(set(self.states)) != len(self.states):
            raise ValueError(f"states {self.states} do not match state_dtypes {sorted(self.state_dtypes)}")
        if set(self.scalars) != {k for k, t in self.tensors.items() if t.numel}:
            raise ValueError("'scalars' must have one entry per saved tensor")
        if len({tuple(sorted(v)) for v in self.scalars.values()}) > 1:  # one optimizer: same scalars
            raise ValueError("saved tensors disagree on their optimizer scalars (e.g. 'step' missing)")
        if len(self.rng) != self.layout.world:
            raise ValueError(f"{len(self.rng)} RNG states for a world of {self.layout.world}")
        need = dict.fromkeys(self.files, 0)  # bytes each shard file must at least hold
        per_elem = 1 + sum(_itemsize(d) for d in self.state_dtypes.values())  # master >= 1 byte
        for key, t in self.tensors.items():
            for s in t.segments:
                if s.file not in need:
                    raise ValueError(f"{key}: segment file {s.file!r} is not listed in 'files'")
                need[s.file] += (s.stop - s.start) * per_elem
        for key, f in self.frozen.items():
            for s in f.segments:
                if s.file not in need:
                    raise ValueError(f"frozen {key}: segment file {s.file!r} is not listed in 'files'")
                need[s.file] += (s.stop - s.start) * _itemsize(f.dtype)
        for key, m in self.module.items():
            if m.file not in need:
                raise ValueError(f"module {key}: file {m.file!r} is not listed in 'files'")
            need[m.file] += _numel(m.shape) * _itemsize(m.dtype)
        for f, n in need.items():
            if n > self.files[f].bytes:
                raise ValueError(f"{f} would need at least {n} bytes for the tensors listed, it has "
                                 f"{self.files[f].bytes}")
        tidx, midx = saved_index(self._dicts(self.tensors)), saved_index(self._dicts(self.module))
        fidx = saved_index(self._dicts(self.frozen))
        named = {"trained": tidx, "module": midx, "frozen": fidx}
        for a, b in (("trained", "module"), ("trained", "frozen"), ("module", "frozen")):
            if both := set(named[a]) & set(named[b]):
                raise ValueError(f"{sorted(both)[:3]} saved both as {a} and as {b} tensors")
        if set(self.module) & set(self.frozen):
            raise ValueError(f"keys {sorted(set(self.module) & set(self.frozen))[:3]} are both module and frozen")
        saved = set(tidx) | set(midx) | set(fidx)
        if len(set(self.excluded_frozen)) != len(self.excluded_frozen) or saved & set(self.excluded_frozen):
            raise ValueError("'excluded_frozen' must list distinct names that are not saved")
        for idx, entries in ((tidx, self.tensors), (midx, self.module), (fidx, self.frozen)):
            d = self._dicts(entries)
            for name, keys in idx.items():
                check_pieces(name, keys, d)
                if len({tuple(d[k]["tp"]["full_shape"]) if d[k]["tp"] else None for k in keys}) != 1:
                    raise ValueError(f"{name}: its TP pieces disagree on the full shape")
        if len(set(self.order)) != len(self.order) or set(self.order) != saved:
            raise ValueError("'order' must list every saved tensor name exactly once")
        return self

    @staticmethod
    def _dicts(entries: dict[str, BaseModel]) -> dict[str, dict]:
        return {k: v.model_dump() for k, v in entries.items()}


def parse_metadata(raw: Any, source: Path) -> dict:
    """Validated metadata as plain dicts (defaults filled), or a CheckpointError naming ``source``."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: expected a JSON object, found {type(raw).__name__}")
    if raw.get("format") != FORMAT:
        raise CheckpointError(f"{source}: not a {FORMAT} checkpoint (format={raw.get('format')!r})")
    v = raw.get("version")
    if isinstance(v, int) and not isinstance(v, bool) and v > VERSION:
        raise CheckpointError(f"{source}: checkpoint format version {v} is newer than this shardwise "
                              f"reads (up to {VERSION}); upgrade shardwise")
    try:
        return Metadata.model_validate(raw).model_dump()
    except ValidationError as e:
        errs = e.errors()
        where = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or '(top)'}: {err['msg']}" for err in errs[:3])
        more = f" (+{len(errs) - 3} more)" if len(errs) > 3 else ""
        raise CheckpointError(f"{source}: invalid checkpoint metadata: {where}{more}") from None
    except (CheckpointError, RecursionError) as e:
        raise CheckpointError(f"{source}: invalid checkpoint metadata: {e}") from None


def match_like(live: Any, saved: Any, where: str, source: Path) -> None:
    """Refuse ``saved`` unless it has the JSON shape of ``live`` (a torch object's own state dict).

    Numbers must be finite numbers (bools are not numbers here), sequences have the live length,
    dicts the live keys. ``None`` in the live state accepts anything JSON (e.g. a lazily set field).
    """
    bad = f"{source}: {where} "
    if live is None:
        return
    if isinstance(live, bool):
        if not isinstance(saved, bool):
            raise CheckpointError(bad + f"must be true/false, found {saved!r}")
    elif isinstance(live, int | float) or (torch.is_tensor(live) and live.numel() == 1):
        if isinstance(saved, bool) or not isinstance(saved, int | float) or not math.isfinite(saved):
            raise CheckpointError(bad + f"must be a finite number, found {saved!r}")
    elif isinstance(live, str):
        if not isinstance(saved, str):
            raise CheckpointError(bad + f"must be a string, found {saved!r}")
    elif isinstance(live, list | tuple):
        if not isinstance(saved, list) or len(saved) != len(live):
            raise CheckpointError(bad + f"must be a list of {len(live)}, found {saved!r}"[:300])
        for i, (a, b) in enumerate(zip(live, saved, strict=True)):
            match_like(a, b, f"{where}[{i}]", source)
    elif isinstance(live, dict):
        if not isinstance(saved, dict) or set(saved) != set(live):
            got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise CheckpointError(bad + f"must have the keys {sorted(live)}, found {got}"[:400])
        for k, v in live.items():
            match_like(v, saved[k], f"{where}[{k!r}]", source)
