"""Tensor-parallel pieces in checkpoints: names, metadata, and resharding to another TP degree.

A TP-sharded parameter NAME is saved as its TP-local tensor (padded rows included) under the
distinct name ``NAME@tp{rank}of{size}``, with its :class:`ShardSpec` in the metadata; the ZeRO
element-range machinery then applies unchanged to each local tensor. Replicated parameters keep
their plain name and are written once (by TP rank 0). A loader at the same degree reads its own
piece directly; at another degree (or when consolidating) :func:`rebuild` assembles the rows a
target needs from the saved pieces that overlap them, one parameter at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardwise.checkpoint.format import CheckpointError
from shardwise.tensor_parallel.layers import ShardSpec

SpecLike = ShardSpec | None


def spec_of(p: torch.Tensor) -> SpecLike:
    """The parameter's TP ShardSpec, or None when it is replicated (or TP is off)."""
    spec = getattr(p, "_tp_spec", None)
    return spec if spec is not None and spec.size > 1 else None


def saved_name(name: str, spec: SpecLike) -> str:
    return name if spec is None else f"{name}@tp{spec.rank}of{spec.size}"


def logical_shape_of(local_shape: list[int], spec: SpecLike) -> list[int]:
    """Full (unpadded, HF) shape of a parameter whose TP-local shape is ``local_shape``."""
    shape = [int(s) for s in local_shape]
    if spec is not None:
        shape[spec.dim] = spec.full
    return shape


def tp_meta(name: str, spec: SpecLike, local_shape: list[int]) -> dict | None:
    """Metadata ``tp`` field of a saved tensor: None (replicated) or its ShardSpec + HF shape."""
    if spec is None:
        return None
    return {"param": name, "dim": spec.dim, "full": spec.full, "size": spec.size, "rank": spec.rank,
            "parts": spec.parts, "full_shape": logical_shape_of(local_shape, spec)}


def spec_from_meta(tp: dict | None) -> SpecLike:
    if not tp:
        return None
    if "param" not in tp:  # version 1 placeholder ({"dim", "parts", "index"}): never written by shardwise
        raise CheckpointError(f"unsupported TP split description {tp} (checkpoint format version 1)")
    return ShardSpec(tp["dim"], tp["full"], tp["size"], tp["rank"], tp["parts"])


def logical_name(key: str, info: dict) -> str:
    tp = info.get("tp")
    return tp["param"] if tp else key


def logical_shape(info: dict) -> list[int]:
    tp = info.get("tp")
    return list(tp["full_shape"]) if tp else list(info["shape"])


def saved_index(entries: dict[str, dict]) -> dict[str, list[str]]:
    """Logical parameter name -> its saved keys (``[NAME]``, or its TP pieces in rank order)."""
    idx: dict[str, list[str]] = {}
    for key, info in entries.items():
        idx.setdefault(logical_name(key, info), []).append(key)
    for keys in idx.values():
        keys.sort(key=lambda k: (entries[k].get("tp") or {}).get("rank", 0))
    return idx


def direct_key(name: str, spec: SpecLike, entries: dict[str, dict]) -> str | None:
    """The saved key holding exactly this rank's tensor (same TP split), or None (reshard)."""
    key = saved_name(name, spec)
    info = entries.get(key)
    if info is None:
        return None
    saved = spec_from_meta(info.get("tp"))
    return key if saved == spec else None


def check_pieces(name: str, keys: list[str], entries: dict[str, dict]) -> None:
    """The saved pieces of one parameter are one consistent split, every TP rank present."""
    specs = [spec_from_meta(entries[k].get("tp")) for k in keys]
    if specs == [None]:
        return
    if None in specs:
        raise CheckpointError(f"{name} is saved both whole and as TP pieces: {keys}")
    first = specs[0]
    want = [first.for_rank(r) for r in range(first.size)]
    if specs != want:
        raise CheckpointError(f"{name}: saved TP pieces {keys} are not ranks 0..{first.size - 1} of one "
                              f"split (dim {first.dim}, size {first.size})")


def _pieces(spec: SpecLike, dim: int, extent: int) -> list[tuple[int, int, int]]:
    return spec.pieces() if spec is not None else [(0, extent, 0)]


def rebuild(name: str, out: torch.Tensor, out_spec: SpecLike, keys: list[str], entries: dict[str, dict],
            load: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """Fill ``out`` (the target's TP-local tensor, or the full tensor when ``out_spec`` is None) from
    the saved tensors ``keys`` of parameter ``name``; ``load(key)`` reads one saved local tensor.

    Only saved pieces that overlap the target's rows are read; padding rows of ``out`` are left
    as they are (zero when ``out`` is fresh).
    """
    check_pieces(name, keys, entries)
    specs = {k: spec_from_meta(entries[k].get("tp")) for k in keys}
    saved_dims = {s.dim for s in specs.values() if s is not None}
    if out_spec is not None and saved_dims and saved_dims != {out_spec.dim}:
        raise CheckpointError(f"{name}: saved TP split along dim {min(saved_dims)}, this model splits it "
                              f"along dim {out_spec.dim}; resharding across split dims is not supported")
    dims = saved_dims | ({out_spec.dim} if out_spec else set())
    if not dims:  # whole -> whole
        out.copy_(load(keys[0]).view(out.shape))
        return out
    dim = dims.pop()
    extent = logical_shape(entries[keys[0]])[dim]
    saved_parts = {s.parts for s in specs.values() if s is not None}
    if out_spec is not None and saved_parts and saved_parts != {out_spec.parts}:
        raise CheckpointError(f"{name}: saved as {min(saved_parts)} fused parts, this model has "
                              f"{out_spec.parts}; cannot reshard")
    want = _pieces(out_spec, dim, extent)
    filled = 0
    for key in keys:
        have = _pieces(specs[key], dim, extent)
        local = None
        for a, b, d in want:
            for sa, sb, sd in have:
                lo, hi = max(a, sa), min(b, sb)
                if lo >= hi:
                    continue
                if local is None:
                    local = load(key).view(entries[key]["shape"])
                out.narrow(dim, d + lo - a, hi - lo).copy_(local.narrow(dim, sd + lo - sa, hi - lo))
                filled += hi - lo
    need = sum(b - a for a, b, _ in want)
    if filled != need:
        raise CheckpointError(f"{name}: the saved TP pieces {keys} cover {filled} of the {need} rows "
                              "this rank needs")
    return out
