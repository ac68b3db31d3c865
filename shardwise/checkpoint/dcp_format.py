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
from pathlib import Path
from typing import Any

import torch

from shardwise.checkpoint.fileio import CheckpointError
from shardwise.checkpoint.foreign import Foreign
from shardwise.checkpoint.unpickle import StandIn, safe_load, safe_load_pickle
from shardwise.checkpoint.validate import confined_path

OPTIM_SECTIONS = ("optim", "optimizer")
MAX_ITEM = 2**40


def _item_bytes(path: Path, info: Any, key: str, cache: dict[str, bytes]) -> bytes:
    """The bytes of one stored item, from a file confined to the folder."""
    src = path / ".metadata"
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(f"{src}: {key} is stored with transforms {info.transform_descriptors}; not read")
    fname, off, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
    if not all(isinstance(x, int) and 0 <= x <= MAX_ITEM for x in (off, length)):
        raise CheckpointError(f"{src}: {key}: bad storage offset/length {off!r}/{length!r}")
    f = confined_path(path, fname, src)
    if fname not in cache:
        if not f.is_file():
            raise CheckpointError(f"{f}: file is missing")
        cache[fname] = f.read_bytes()
    data = cache[fname]
    if off + length > len(data):
        raise CheckpointError(f"{f}: {key} needs bytes [{off}, {off + length}), the file has {len(data)}")
    return data[off:off + length]


def _assemble(path: Path, key: str, md: Any, items: list[tuple[Any, bytes]]) -> torch.Tensor:
    """A tensor from its chunks, each checked against the metadata; the chunks must tile it."""
    src = path / ".metadata"
    dtype, size = md.properties.dtype, [int(s) for s in md.size]
    if len(size) > 8 or math.prod(size) > MAX_ITEM:
        raise CheckpointError(f"{src}: {key} has an implausible size {size}")
    out = torch.zeros(size, dtype=dtype)
    covered = torch.zeros(size, dtype=torch.bool)
    for chunk, blob in items:
        t = safe_load(blob, path / f"{key} chunk")
        offs, sizes = [int(o) for o in chunk.offsets], [int(s) for s in chunk.sizes]
        if not torch.is_tensor(t) or t.dtype != dtype or list(t.shape) != sizes or len(offs) != len(size) \
                or any(o < 0 or o + s > n for o, s, n in zip(offs, sizes, size, strict=True)):
            raise CheckpointError(f"{src}: a chunk of {key} does not match its metadata (dtype {dtype}, size "
                                  f"{sizes} at {offs} of {size})")
        region = tuple(slice(o, o + s) for o, s in zip(offs, sizes, strict=True))
        if covered[region].any():
            raise CheckpointError(f"{src}: chunks of {key} overlap")
        out[region], covered[region] = t, True
    if not covered.all():
        raise CheckpointError(f"{src}: the chunks of {key} cover {int(covered.sum())} of {covered.numel()} elements")
    return out


def _read_all(path: Path, meta: Any) -> dict[tuple, Any]:
    """Every stored value by its path in the saved nested dict."""
    src = path / ".metadata"
    if not isinstance(meta, StandIn) or not all(hasattr(meta, a) for a in ("state_dict_metadata", "storage_data")):
        raise CheckpointError(f"{src}: not a DCP Metadata object")
    planner = getattr(meta, "planner_data", None) or {}
    by_key: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in meta.storage_data.items():
        by_key.setdefault(getattr(index, "fqn", None), []).append((index, info))
    cache: dict[str, bytes] = {}
    out: dict[tuple, Any] = {}
    for key, md in meta.state_dict_metadata.items():
        where = planner.get(key, (key,))
        items = by_key.get(key, [])
        if not isinstance(where, tuple) or not items:
            raise CheckpointError(f"{src}: {key} has no stored data or no planner path")
        if hasattr(md, "chunks"):
            chunks = {tuple(int(o) for o in c.offsets): c for c in md.chunks}
            pairs = [(chunks.get(tuple(int(o) for o in getattr(idx, "offset", ()) or ())), info) for idx, info in items]
            if any(c is None for c, _ in pairs) or len(pairs) != len(chunks):
                raise CheckpointError(f"{src}: the stored chunks of {key} do not match its metadata")
            out[where] = _assemble(path, key, md, [(c, _item_bytes(path, i, key, cache)) for c, i in pairs])
        else:
            out[where] = safe_load(_item_bytes(path, items[0][1], key, cache), path / f"{key} item")
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
        found.trained[name] = (t.float(), t.dtype)
        for k in per_elem:
            if k not in (st or {}):
                raise CheckpointError(f"{src}: optimizer state {k!r} of {name} is missing")
            found.states.setdefault(k, {})[name] = st[k]
        if st:
            scal = {k: float(v) for k, v in st.items() if k not in per_elem}
            if set(st) - set(per_elem) - set(scal) or any(not math.isfinite(x) for x in scal.values()):
                raise CheckpointError(f"{src}: optimizer state of {name} holds non-numeric scalars")
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
