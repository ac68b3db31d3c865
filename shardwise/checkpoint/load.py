"""Load a checkpoint into any layout: each rank reads only the element ranges its own shards need.

Two phases, so a bad checkpoint never leaves a half-loaded engine nor a rank waiting in a
collective: (1) every rank verifies the files it needs and reads its slices into fresh tensors;
all ranks agree that every rank succeeded; (2) the tensors are installed and published.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardwise.checkpoint.fileio import (
    FORMAT,
    VERSION,
    CheckpointError,
    ShardReader,
    agree,
    dtype_from_name,
    like,
    read_json,
    set_rng_state,
    world_comm,
)
from shardwise.checkpoint.save import IMPL_KEYS, full_shape, module_extras
from shardwise.checkpoint.tp import (
    direct_key,
    logical_shape,
    logical_shape_of,
    rebuild,
    saved_index,
    spec_of,
)

if TYPE_CHECKING:
    from shardwise.engine import Engine

log = logging.getLogger("shardwise")


def resolve_tag(load_dir: str | Path, tag: str | None) -> Path | None:
    """``load_dir/tag``, the tag named by ``latest``, or None when there is no ``latest`` file."""
    root = Path(load_dir)
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            return None
        tag = latest.read_text().strip()
    path = root / str(tag)
    if not path.is_dir() and (root / f".{tag}.old").is_dir():
        path = root / f".{tag}.old"  # a save that overwrote this tag stopped between two renames
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint (tags here: "
                              f"{sorted(p.name for p in root.iterdir() if p.is_dir())})")
    return path


def read_metadata(path: Path) -> dict:
    meta = read_json(path / "metadata.json")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path / 'metadata.json'}: not a {FORMAT} checkpoint "
                              f"(format={meta.get('format')!r})")
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(f"{path / 'metadata.json'}: checkpoint format version {meta.get('version')!r}"
                              f" is newer than this shardwise reads (up to {VERSION}); upgrade shardwise")
    return meta


def _check_fits(engine: Engine, meta: dict, path: Path) -> None:
    """Every trainable parameter is saved (whole, or as TP pieces of any degree) with its HF shape."""
    tensors = meta["tensors"]
    index = saved_index(tensors)
    missing, wrong = [], []
    for g in engine.groups:
        for name, p, n in zip(g.names, g.params, g.numels, strict=True):
            spec = spec_of(p)
            key = direct_key(name, spec, tensors)
            if key is not None:
                if tensors[key]["numel"] != n:
                    wrong.append(f"{key} ({tensors[key]['numel']} saved, {n} here)")
            elif name not in index:
                missing.append(name)
            elif (saved := logical_shape(tensors[index[name][0]])) != (here := logical_shape_of(full_shape(p),
                                                                                                spec)):
                wrong.append(f"{name} (shape {saved} saved, {here} here)")
    if missing or wrong:
        raise CheckpointError(f"{path}: does not fit this model: missing {missing[:5]}"
                              f"{'...' if len(missing) > 5 else ''}, size mismatch {wrong[:5]}")


def read_saved(reader: ShardReader, tensors: dict, prefix: str, key: str, dtype: torch.dtype) -> torch.Tensor:
    """The whole saved tensor ``prefix/key`` (a trainable one's local TP piece), in its saved shape."""
    info = tensors[key]
    buf = torch.empty(info["numel"], dtype=dtype)
    reader.read_range(f"{prefix}/{key}", info["segments"], 0, info["numel"], buf)
    return buf.view(info["shape"])


def _read_own(engine: Engine, meta: dict, reader: ShardReader, states: list[str]) -> list[dict]:
    """Per group: {"master": tensor, state: tensor, ..., "scalars": {...}} for this rank's range.

    A parameter saved with this rank's TP split is read by element range; one saved at another TP
    degree is rebuilt whole (its overlapping TP pieces read) and then cut to this rank's range.
    """
    tensors, out = meta["tensors"], []
    index = saved_index(tensors)
    for g in engine.groups:
        bufs = {"master": torch.zeros(g.own_numel, dtype=g.master.dtype)}
        for k in states:
            bufs[k] = torch.zeros(g.own_numel, dtype=dtype_from_name(meta["state_dtypes"][k]))
        first = None  # the scalars (Adam's step) of the first parameter this rank holds part of
        for name, p, off, n in zip(g.names, g.params, g.offsets, g.numels, strict=True):
            a, b = max(off, g.own_start), min(off + n, g.own_start + g.own_numel)
            if a >= b:
                continue
            spec = spec_of(p)
            key = direct_key(name, spec, tensors)
            first = first or key or index[name][0]
            for k, buf in bufs.items():
                dst = buf.narrow(0, a - g.own_start, b - a)
                if key is not None:
                    reader.read_range(f"{k}/{key}", tensors[key]["segments"], a - off, b - off, dst)
                    continue
                local = torch.zeros(full_shape(p), dtype=buf.dtype)
                rebuild(name, local, spec, index[name], tensors,
                        lambda s, k=k, dt=buf.dtype: read_saved(reader, tensors, k, s, dt))
                dst.copy_(local.view(-1)[a - off: b - off])
        scal = meta["scalars"].get(first, {}) if states and first else {}
        out.append({"bufs": bufs, "scalars": scal})
    return out


def _read_module(engine: Engine, meta: dict, reader: ShardReader) -> dict[str, torch.Tensor]:
    """Frozen parameters and buffers, whole or as this rank's TP piece (resharded if saved otherwise)."""
    live = module_extras(engine)
    saved = meta["module"]
    out = {}
    for name, keys in saved_index(saved).items():
        if name not in live:
            raise CheckpointError(f"{reader.folder}: saved tensor {name} is not in this model")
        spec, t = spec_of(live[name]), live[name]
        key = direct_key(name, spec, saved)
        if key is not None:
            out[name] = reader.read_full(f"module/{key}", saved[key]["file"])
            continue
        if logical_shape(saved[keys[0]]) != logical_shape_of(list(t.shape), spec):
            raise CheckpointError(f"{reader.folder}: {name} has shape {logical_shape(saved[keys[0]])} in "
                                  f"the checkpoint, {logical_shape_of(list(t.shape), spec)} here")
        out[name] = rebuild(name, torch.zeros(t.shape, dtype=dtype_from_name(saved[keys[0]]["dtype"])),
                            spec, keys, saved, lambda s: reader.read_full(f"module/{s}", saved[s]["file"]))
    return out


def _load_optimizer(engine: Engine, meta: dict, loaded: list[dict]) -> None:
    """Build a torch optimizer state_dict for the live masters and hand it to ``load_state_dict``.

    torch then applies its own dtype/device rules (``step`` on CPU unless fused/capturable).
    """
    opt = engine.optimizer
    sd = opt.state_dict()
    if len(sd["param_groups"]) != len(meta["param_groups"]):
        raise CheckpointError(f"checkpoint has {len(meta['param_groups'])} optimizer param groups, "
                              f"this engine {len(sd['param_groups'])}")
    groups = []
    for cur, saved in zip(sd["param_groups"], meta["param_groups"], strict=True):
        g = dict(cur)
        g.update({k: like(cur[k], v) for k, v in saved.items() if k in cur and k not in IMPL_KEYS})
        groups.append(g)
    index = {}
    for pg_live, pg_sd in zip(opt.param_groups, sd["param_groups"], strict=True):
        index.update({id(p): i for p, i in zip(pg_live["params"], pg_sd["params"], strict=True)})
    state: dict[int, dict[str, Any]] = {}
    if meta["states"]:
        for g, got in zip(engine.groups, loaded, strict=True):
            st: dict[str, Any] = {k: v for k, v in got["bufs"].items() if k != "master"}
            for k, s in got["scalars"].items():
                st[k] = s["value"] if s["dtype"] is None else torch.tensor(
                    s["value"], dtype=dtype_from_name(s["dtype"]))
            state[index[id(g.master)]] = st
    opt.load_state_dict({"state": state, "param_groups": groups})


def load_checkpoint(engine: Engine, load_dir: str | Path, tag: str | None = None,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, verify: bool = True) -> tuple[str | None, dict | None]:
    """Load ``load_dir/tag`` (default: the tag in ``latest``); returns ``(path, client_state)``.

    Collective. As DeepSpeed, returns ``(None, None)`` with a warning when ``tag`` is None and
    there is no ``latest`` file. ``verify=False`` skips the sha256 pass (sizes are still checked).
    """
    path = resolve_tag(load_dir, tag)
    if path is None:
        log.warning(f"no 'latest' file in {load_dir}: nothing loaded (pass tag= to pick a checkpoint)")
        return None, None
    comm = world_comm()
    with_opt = load_optimizer_states and not load_module_only
    err: BaseException | None = None
    meta, loaded, module = {}, [], {}
    try:
        meta = read_metadata(path)
        _check_fits(engine, meta, path)
        reader = ShardReader(path, meta["files"], verify=verify)
        loaded = _read_own(engine, meta, reader, meta["states"] if with_opt else [])
        module = _read_module(engine, meta, reader)
        reader.release()
    except BaseException as e:  # noqa: BLE001 - re-raised on every rank by agree()
        err = e
    agree(comm, err, f"load_checkpoint({path})")

    live = module_extras(engine) if module else {}
    with torch.no_grad():
        for g, got in zip(engine.groups, loaded, strict=True):
            g.master.copy_(got["bufs"]["master"])
        for g in engine.groups:
            g.publish_master()
        for name, t in module.items():
            live[name].data.copy_(t)
    if load_module_only:
        return str(path), meta["client_state"]
    if with_opt:
        _load_optimizer(engine, meta, loaded)
    if load_lr_scheduler_states and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    if engine.loss_scaler is not None and meta["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(meta["loss_scaler"])
    c = meta["counters"]
    # Partial accumulations are not saved, so the loaded engine starts at a boundary of its own
    # accumulation count (the saved micro_steps count another layout's gas when the world changed).
    engine.global_steps, engine.micro_steps = c["global_steps"], c["global_steps"] * engine.gas
    engine.skipped_steps = c["skipped_steps"]
    lay = meta["layout"]  # per-rank streams only mean something in the same layout
    if lay["world"] == comm.size and lay.get("tp", 1) == engine.tp.size:
        set_rng_state(meta["rng"][comm.rank])
    return str(path), meta["client_state"]
