"""PyTorch Distributed Checkpoint folders (``dcp.save``: FSDP2 ``get_state_dict``, torchtitan).

Layout (torch 2.13): ``.metadata`` is a plain pickle of DCP's ``Metadata``: per flattened key its
``TensorStorageMetadata`` (dtype, full size, chunks as offsets + sizes) or ``BytesStorageMetadata``,
``planner_data`` (each flattened key's path in the saved nested dict) and ``storage_data`` (per
chunk: file, byte offset, length). Each item in a ``__R_N.distcp`` file is an ordinary
``torch.save`` blob (a tensor chunk, or a Python value such as a param group's ``lr``).

Mapping, by each key's path: ``(model, FQN)`` or a top-level ``(FQN,)`` (torchtitan) is a model
tensor; ``(optim|optimizer, state, FQN, NAME)`` an optimizer state (``exp_avg``, ``exp_avg_sq``:
per element; ``step``: scalar); ``(optim|optimizer, param_groups, I, KEY)`` a hyperparameter.
Other sections (torchtitan's ``lr_scheduler``, ``dataloader``, ``train_state``) are not read.
Model tensors with optimizer state become trained parameters (masters), the others frozen
parameters or buffers. Every chunk is unpickled without executing anything, checked against its
declared shape and dtype, and the chunks must tile each tensor exactly. DCP saves no step count:
``global_steps`` is Adam's ``step``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint.fileio import CheckpointError
from shardwise.checkpoint.foreign import Foreign, require_finite
from shardwise.checkpoint.unpickle import StandIn, safe_load, safe_load_pickle
from shardwise.checkpoint.validate import confined_path
from shardwise.files.safe import open_regular

OPTIM_SECTIONS = ("optim", "optimizer")
MAX_ITEM = 2**40


def _ints(v: Any, n: int | None = None) -> list[int] | None:
    """``v`` as a list of at most 8 ints in [0, MAX_ITEM] (of length ``n`` when given), else None."""
    if not isinstance(v, list | tuple | torch.Size):
        return None
    out = list(v)
    if len(out) > 8 or (n is not None and len(out) != n) or \
            not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_ITEM for x in out):
        return None
    return out


class _Files:
    """The ``.distcp`` files, confined to the folder; every stored item's byte range checked against
    the file's real size, and no two items of a file sharing bytes, before anything is read. So the
    bytes the items claim add up to at most the files' bytes."""

    def __init__(self, path: Path):
        self.path, self.src = path, path / ".metadata"
        self.ranges: dict[str, list[tuple[int, int]]] = {}

    def claim(self, info: Any, key: str) -> tuple[str, int, int]:
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{self.src}: {key} is stored with transforms {info.transform_descriptors}; "
                                  "not read")
        fname, off, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if _ints([off, length]) is None:
            raise CheckpointError(f"{self.src}: {key}: bad storage offset/length {off!r}/{length!r}")
        f = confined_path(self.path, fname, self.src)
        if fname not in self.ranges:
            if not f.is_file():
                raise CheckpointError(f"{f}: file is missing")
            self.ranges[fname] = []
        size = f.stat().st_size
        if off + length > size:
            raise CheckpointError(f"{f}: {key} needs bytes [{off}, {off + length}), the file has {size}")
        self.ranges[fname].append((off, off + length))
        return fname, off, length

    def check_disjoint(self) -> None:
        for fname, ranges in self.ranges.items():
            ranges.sort()
            for (_, a_end), (b, _) in zip(ranges, ranges[1:], strict=False):
                if b < a_end:
                    raise CheckpointError(f"{self.path / fname}: two stored items share bytes at {b} "
                                          f"(in {self.src}); refused before reading")

    def read(self, item: tuple[str, int, int]) -> bytes:
        """One item's bytes, read alone (``pread``): the files are never held in memory whole."""
        fname, off, length = item
        f = confined_path(self.path, fname, self.src)
        fd = open_regular(f, CheckpointError, nofollow=True)
        try:
            data = os.pread(fd, length, off)
        finally:
            os.close(fd)
        if len(data) != length:
            raise CheckpointError(f"{f}: bytes [{off}, {off + length}) are past its end (it was cut short while "
                                  "being read)")
        return data


def _plan_tensor(src: Path, key: str, md: Any, claims: list[tuple[Any, tuple[str, int, int]]]) -> None:
    """Refuse a tensor whose metadata the stored bytes cannot back, before allocating it: a size of
    at most 8 dims and ``MAX_ITEM`` elements, chunks inside it whose volumes add up to it, and each
    chunk's stored item at least as long as the chunk's bytes."""
    size = _ints(getattr(md, "size", None))
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    if size is None or not isinstance(dtype, torch.dtype) or math.prod(size) > MAX_ITEM:
        raise CheckpointError(f"{src}: {key} has an implausible size {getattr(md, 'size', None)!r} or dtype")
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = 0
    for chunk, (_, _, length) in claims:
        offs = _ints(getattr(chunk, "offsets", None), len(size))
        sizes = _ints(getattr(chunk, "sizes", None), len(size))
        if offs is None or sizes is None or any(o + s > n for o, s, n in zip(offs, sizes, size, strict=True)):
            raise CheckpointError(f"{src}: a chunk of {key} lies outside its size {size}")
        if math.prod(sizes) * itemsize > length:
            raise CheckpointError(f"{src}: a chunk of {key} ({sizes}, {dtype}) needs {math.prod(sizes) * itemsize} "
                                  f"bytes, its stored item has {length}")
        total += math.prod(sizes)
    if total != math.prod(size):
        raise CheckpointError(f"{src}: the chunks of {key} hold {total} elements, its size {size} has "
                              f"{math.prod(size)}")


def _assemble(path: Path, key: str, md: Any, items: list[tuple[Any, bytes, str]]) -> torch.Tensor:
    """A tensor from its chunks (already planned by :func:`_plan_tensor`), each checked against the
    metadata; the chunks must tile it."""
    src = path / ".metadata"
    dtype, size = md.properties.dtype, [int(s) for s in md.size]
    out = torch.zeros(size, dtype=dtype)
    covered = torch.zeros(size, dtype=torch.bool)
    for chunk, blob, fname in items:
        t = safe_load(blob, path / f"{fname}[{key}]")  # errors name the file and the item
        offs, sizes = [int(o) for o in chunk.offsets], [int(s) for s in chunk.sizes]
        if not torch.is_tensor(t) or t.dtype != dtype or list(t.shape) != sizes:
            raise CheckpointError(f"{src}: a chunk of {key} does not match its metadata (dtype {dtype}, size "
                                  f"{sizes} at {offs} of {size})")
        region = tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))
        if covered[region].any():
            raise CheckpointError(f"{src}: chunks of {key} overlap")
        out[region], covered[region] = t, True
    if not covered.all():
        raise CheckpointError(f"{src}: the chunks of {key} cover {int(covered.sum())} of {covered.numel()} elements")
    return out


def _chunk_claims(files: _Files, src: Path, key: str, md: Any, items: list) -> list:
    """(chunk, item) pairs of one tensor: one stored item per chunk, matched by offset."""
    if not isinstance(md.chunks, list) or len(md.chunks) != len(items):
        raise CheckpointError(f"{src}: the stored chunks of {key} do not match its metadata")
    chunks = {tuple(_ints(getattr(c, "offsets", None)) or ()): c for c in md.chunks}
    pairs = [(chunks.get(tuple(_ints(getattr(idx, "offset", None)) or ())), info) for idx, info in items]
    if any(c is None for c, _ in pairs) or len(pairs) != len(chunks):
        raise CheckpointError(f"{src}: the stored chunks of {key} do not match its metadata")
    claims = [(c, files.claim(i, key)) for c, i in pairs]
    _plan_tensor(src, key, md, claims)
    return claims


def _plan(path: Path, meta: Any) -> tuple[_Files, list[tuple[tuple, str, Any, list]]]:
    """Every stored value's path, key, metadata and (chunk, item) claims, all checked before a byte
    of a ``.distcp`` file is read or any tensor allocated."""
    src = path / ".metadata"
    if not isinstance(meta, StandIn) or not all(isinstance(getattr(meta, a, None), dict)
                                                for a in ("state_dict_metadata", "storage_data")):
        raise CheckpointError(f"{src}: not a DCP Metadata object")
    planner = getattr(meta, "planner_data", None) or {}
    by_key: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in meta.storage_data.items():
        by_key.setdefault(getattr(index, "fqn", None), []).append((index, info))
    files, plan = _Files(path), []
    for key, md in meta.state_dict_metadata.items():
        where = planner.get(key, (key,)) if isinstance(planner, dict) else None
        items = by_key.get(key, [])
        if not isinstance(where, tuple) or not items:
            raise CheckpointError(f"{src}: {key} has no stored data or no planner path")
        if hasattr(md, "chunks"):
            claims = _chunk_claims(files, src, key, md, items)
        else:
            claims = [(None, files.claim(items[0][1], key))]
        plan.append((where, key, md, claims))
    files.check_disjoint()
    return files, plan


def _read_all(path: Path, meta: Any) -> dict[tuple, Any]:
    """Every stored value by its path in the saved nested dict."""
    files, plan = _plan(path, meta)
    out: dict[tuple, Any] = {}
    for where, key, md, claims in plan:
        if hasattr(md, "chunks"):
            out[where] = _assemble(path, key, md, [(c, files.read(item), item[0]) for c, item in claims])
        else:
            out[where] = safe_load(files.read(claims[0][1]), path / f"{claims[0][1][0]}[{key}]")
    return out


def _sections(values: dict[tuple, Any], src: Path) -> tuple[dict, dict, dict[int, dict]]:
    """(model tensors, optimizer state by fqn, param groups by index)."""
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    groups: dict[int, dict] = {}
    for where, v in values.items():
        if len(where) == 4 and where[0] in OPTIM_SECTIONS and where[1] == "state":
            state.setdefault(where[2], {})[where[3]] = v
        elif len(where) == 4 and where[0] in OPTIM_SECTIONS and where[1] == "param_groups":
            groups.setdefault(int(where[2]), {})[where[3]] = v
        elif (len(where) == 2 and where[0] == "model") or (len(where) == 1 and torch.is_tensor(v)):
            if not torch.is_tensor(v):
                raise CheckpointError(f"{src}: model entry {where[-1]} is not a tensor")
            model[where[-1]] = v
    return model, state, groups


def _number(v: Any) -> bool:
    return (torch.is_tensor(v) and v.numel() == 1) or (isinstance(v, int | float) and not isinstance(v, bool))


def read_dcp(path: Path) -> Foreign:
    """The DCP checkpoint in ``path`` as full per-parameter tensors."""
    src = path / ".metadata"
    model, state, groups = _sections(_read_all(path, safe_load_pickle(src)), src)
    if not model:
        raise CheckpointError(f"{src}: no model tensors (keys 'model.*' or top-level tensors)")
    if unknown := sorted(set(state) - set(model)):
        raise CheckpointError(f"{src}: optimizer state for {unknown[:3]}, which are not model tensors")
    found = Foreign(source=path, world=1, stage=3)
    per_elem = sorted({k for s in state.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0})
    for name, t in model.items():
        st = state.get(name)
        if st is None and state:
            found.extras[name] = t
            continue
        require_finite(t, src, f"model tensor {name}")
        found.trained[name] = (t.float(), t.dtype)
        for k in per_elem:
            if k not in (st or {}):
                raise CheckpointError(f"{src}: optimizer state {k!r} of {name} is missing")
            require_finite(st[k], src, f"optimizer state {k!r} of {name}")
            found.states.setdefault(k, {})[name] = st[k]
        if st:
            scal = {k: float(v) for k, v in st.items() if k not in per_elem and _number(v)}
            if set(st) - set(per_elem) - set(scal):
                raise CheckpointError(f"{src}: optimizer state of {name} holds non-numeric scalars")
            for k, v in scal.items():
                require_finite(v, src, f"optimizer state {k!r} of {name}")
            found.scalars[name] = scal
    found.order = list(model)
    found.param_groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in groups[i].items() if k != "params"}
                          for i in sorted(groups)]
    members = [groups[i].get("params") for i in sorted(groups)]
    if all(isinstance(m, list) and all(isinstance(n, str) for n in m) for m in members):
        found.group_members = members
    steps = {v.get("step") for v in found.scalars.values()}
    found.global_steps = int(max(s for s in steps if s is not None)) if steps - {None} else 0
    return found
