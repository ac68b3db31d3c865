"""Frozen parameters in checkpoints (LoRA / PEFT fine-tunes: base weights frozen, adapters trained).

A frozen parameter has no fp32 master and no optimizer state; what persists is the parameter
itself. Stages 0-2 keep it whole on every rank; stage 3 keeps only this rank's shard of its
group's flat buffer, in the group's store (``g.param_shard``). The checkpoint's ``frozen`` section
records it like a trained tensor ("elements [a, b) of the flattened KEY", in segments of the rank
files, under ``frozen/KEY``) but in the parameter's own dtype:

* stage 3: every rank writes the element ranges its shard holds (``g.owned``, from the group's
  :class:`~shardwise.zero.layout.FlatLayout`), straight from the store: nothing is gathered;
* stages 0-2: data-parallel rank 0 writes each frozen parameter whole, as one segment.

A loader at any world size, stage or TP degree reads the ranges it needs: a whole (TP-local)
tensor for an unsharded parameter, its shard's ranges for a stage-3 frozen group.
``exclude_frozen_parameters=True`` (DeepSpeed's keyword) writes none of them and lists their
names in ``excluded_frozen``: a load leaves those parameters as the model has them. Format-2
checkpoints held frozen parameters whole in the ``module`` section; they still load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shardwise.checkpoint.fileio import CheckpointError, ShardReader, dtype_from_name, dtype_name
from shardwise.checkpoint.tp import direct_key, rebuild, saved_index, saved_name, spec_of, tp_meta

if TYPE_CHECKING:
    from shardwise.checkpoint.target import CheckpointTarget
    from shardwise.zero.flat_group import ShardedGroup

PREFIX = "frozen"  # shard-file tensors of frozen parameters: frozen/KEY


def full_shape(p: torch.Tensor) -> list[int]:
    """The parameter's shape on this rank (stage 3's released placeholders keep the full shape).

    Under TP this is the TP-local (padded) shape; ``tp.logical_shape_of`` gives the HF shape.
    """
    return [int(s) for s in p.shape]


def module_extras(engine: CheckpointTarget, params: bool = True, buffers: bool = True) -> dict[str, torch.Tensor]:
    """Unsharded frozen parameters and persistent buffers by state_dict name (tied tensors once).

    Stage-3 frozen parameters are not here: their groups hold them (:func:`frozen_groups`).
    Walks the modules instead of calling ``state_dict()``, which stage 3 refuses while sharded.
    """
    from shardwise.zero.flat_group import owner_of

    grouped = {id(p) for g in engine.groups for p in g.params}
    out: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters() if params else ():
        if id(p) not in grouped and owner_of(p) is None:
            out[name] = p
    seen: set[int] = set()
    for mname, m in engine.module.named_modules() if buffers else ():
        for bname, b in m.named_buffers(recurse=False):
            if b is None or bname in m._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            out[f"{mname}.{bname}" if mname else bname] = b
    return out


def frozen_groups(engine: CheckpointTarget) -> list[ShardedGroup]:
    """Stage 3's groups of frozen parameters (no master: the store's shard is the only copy), in
    model order. Found through the parameters, so the engine and ``shardwise.shard`` both work."""
    from shardwise.zero.flat_group import owner_of

    trained = {id(g) for g in engine.groups}
    found: dict[int, ShardedGroup] = {}
    for _, p in engine.module.named_parameters():
        g = owner_of(p)
        if g is not None and id(g) not in trained and not g.trainable:
            found.setdefault(id(g), g)
    return list(found.values())


def frozen_names(engine: CheckpointTarget) -> list[str]:
    """Every frozen parameter's name (what ``exclude_frozen_parameters`` leaves out)."""
    names = list(module_extras(engine, buffers=False))
    return names + [n for g in frozen_groups(engine) for n in g.names]


def _shard_of(g: ShardedGroup) -> torch.Tensor:
    if g.param_shard is None:
        raise NotImplementedError(f"frozen parameter {g.names[0]} is file-backed (no resident shard): its "
                                  "checkpoint is the files it is read from; save a training engine instead")
    return g.param_shard


def describe_frozen(engine: CheckpointTarget, sharded_writes: bool, whole_writes: bool, tp_rank: int,
                    exclude: bool) -> tuple[dict, dict, list[tuple[str, torch.Tensor]], list[str]]:
    """This rank's part of the manifest: ``(entries, segments, pieces, excluded names)``.

    ``sharded_writes``: this rank writes its stage-3 shard ranges (the first replica);
    ``whole_writes``: it writes the unsharded frozen parameters (data-parallel rank 0). Replicated
    over TP, a parameter is written by TP rank 0 only.
    """
    if exclude:
        return {}, {}, [], frozen_names(engine)
    entries: dict[str, dict] = {}
    segments: dict[str, list[int]] = {}
    pieces: list[tuple[str, torch.Tensor]] = []

    def entry(name: str, p: torch.Tensor, dtype: torch.dtype) -> str | None:
        spec = spec_of(p)
        if spec is None and tp_rank != 0:
            return None  # replicated over TP: TP rank 0 saves it
        key, shape = saved_name(name, spec), full_shape(p)
        entries[key] = {"shape": shape, "numel": p.numel(), "dtype": dtype_name(dtype),
                        "tp": tp_meta(name, spec, shape), "segments": []}
        return key

    for g in frozen_groups(engine):
        keys = [entry(name, p, g.dtype) for name, p in zip(g.names, g.params, strict=True)]
        if not sharded_writes:
            continue
        shard = _shard_of(g)
        for seg in g.owned:
            if keys[seg.index] is not None:
                segments[keys[seg.index]] = [seg.start, seg.stop]
                pieces.append((f"{PREFIX}/{keys[seg.index]}", shard.narrow(0, seg.offset, seg.length)))
    for name, p in module_extras(engine, buffers=False).items() if whole_writes else ():
        key = entry(name, p, p.dtype)
        if key is not None:
            segments[key] = [0, p.numel()]
            pieces.append((f"{PREFIX}/{key}", p.detach().reshape(-1)))
    return entries, segments, pieces, []


# -- load ---------------------------------------------------------------------------------------
def saved_extras(meta: dict) -> dict[str, dict]:
    """Saved entries an untrained tensor may come from: ``module`` (buffers; frozen parameters in
    format 2) and ``frozen``. Their keys are disjoint (validate.py)."""
    return {**meta["module"], **meta["frozen"]}


def read_whole(reader: ShardReader, entries: dict, key: str) -> torch.Tensor:
    """Saved tensor ``key`` whole, in its saved dtype and (TP-local) shape, from either section."""
    info = entries[key]
    dtype = dtype_from_name(info["dtype"])
    if "segments" not in info:  # a module entry: one tensor in one file
        return reader.read_full(f"module/{key}", info["file"], dtype, info["shape"])
    buf = torch.empty(info["numel"], dtype=dtype)
    reader.read_range(f"{PREFIX}/{key}", info["segments"], 0, info["numel"], buf)
    return buf.view(info["shape"])


def read_frozen_shards(engine: CheckpointTarget, meta: dict, reader: ShardReader,
                       skip: set[str]) -> list[tuple[Any, torch.Tensor]]:
    """Per stage-3 frozen group, the new shard: this rank's ranges read from the checkpoint.

    A range saved as segments at this rank's TP split is read directly (any world size or
    bucketing); otherwise (another TP degree, or a whole format-2 module tensor) the parameter is
    rebuilt whole and cut. Names in ``skip`` (excluded, or absent and not strict) keep their values.
    """
    entries = saved_extras(meta)
    index = saved_index(entries)
    out = []
    for g in frozen_groups(engine):
        if g.param_shard is None:
            raise CheckpointError(f"frozen parameter {g.names[0]} is read from files at every use (file-backed "
                                  "store); it cannot load a checkpoint")
        shard = g.param_shard.detach().clone()
        for seg in g.owned:
            name, p = g.names[seg.index], g.params[seg.index]
            if name in skip:
                continue
            spec, dst = spec_of(p), shard.narrow(0, seg.offset, seg.length)
            key = direct_key(name, spec, entries)
            dtype = dtype_from_name(entries[key or index[name][0]]["dtype"])
            if key is not None and "segments" in entries[key]:
                tmp = torch.empty(seg.length, dtype=dtype)
                reader.read_range(f"{PREFIX}/{key}", entries[key]["segments"], seg.start, seg.stop, tmp)
                dst.copy_(tmp)
                continue
            local = torch.zeros(full_shape(p), dtype=dtype)
            rebuild(name, local, spec, index[name], entries, lambda k: read_whole(reader, entries, k))
            dst.copy_(local.view(-1)[seg.start:seg.stop])
        out.append((g, shard))
    return out


def install_frozen_shards(staged: list[tuple[Any, torch.Tensor]]) -> None:
    """The loaded shards become the stores' copies; the next gather all-gathers them."""
    for g, shard in staged:
        g.drop_secondary()
        g.store.update(shard)

