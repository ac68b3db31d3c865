"""Load a checkpoint into any layout: each rank reads only the element ranges its own shards need.

All or nothing, and the same outcome on every rank: (1) every rank validates the metadata
(``validate.py``), matches every saved name to the model, verifies the files it needs and reads
its slices, module tensors, optimizer, scheduler and RNG state into staging objects; (2) all ranks
agree that every rank succeeded (or all raise the failing rank's CheckpointError); (3) only then is
anything installed. A failed load leaves the engine exactly as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardwise.checkpoint import async_save
from shardwise.checkpoint.experts import saved_offset, saved_shape
from shardwise.checkpoint.fileio import (
    CheckpointError,
    ShardReader,
    agree,
    dtype_from_name,
    dtype_name,
    like,
    rng_setter,
    world_comm,
)
from shardwise.checkpoint.formats import adapt_scheduler, check_foreign_optimizer, is_foreign, open_checkpoint
from shardwise.checkpoint.frozen import (
    frozen_groups,
    full_shape,
    install_frozen_shards,
    module_extras,
    read_frozen_shards,
    read_whole,
    saved_extras,
)
from shardwise.checkpoint.load_plan import hashed_ahead
from shardwise.checkpoint.publish import IMPL_KEYS
from shardwise.checkpoint.tp import (
    direct_key,
    logical_shape,
    logical_shape_of,
    rebuild,
    saved_index,
    spec_of,
)
from shardwise.checkpoint.validate import confined_path, match_like
from shardwise.checkpoint.whole_tensor_state import check_state_layout, stage_whole_state
from shardwise.files.safe import read_regular
from shardwise.zero.low_precision import COMPENSATION, kept_state_dtype, master_buffer, settle_master

if TYPE_CHECKING:
    from shardwise.checkpoint.target import CheckpointTarget

log = logging.getLogger("shardwise")


def _read_latest(latest: Path) -> str:
    """The tag named in ``latest``: short UTF-8 text naming a plain folder, else refused."""
    raw = read_regular(latest, 1 << 20, CheckpointError)
    try:
        tag = raw.decode("utf-8").strip() if len(raw) <= 1024 else None
    except UnicodeDecodeError:
        tag = None
    if not tag or not tag.isprintable() or "/" in tag or "\\" in tag or tag.startswith("."):
        raise CheckpointError(f"{latest}: does not hold a checkpoint tag (a plain folder name), found "
                              f"{raw[:60]!r}; pass tag= or rewrite the file")
    return tag


def resolve_tag(load_dir: str | Path, tag: str | None) -> Path | None:
    """``load_dir/tag``, the tag named by ``latest``, or None when there is no ``latest`` file.

    Both the tag and ``latest`` itself must stay inside ``load_dir`` (no absolute path, ``..`` or
    symlink out of it).
    """
    root = Path(load_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint folder")
    source: Path | str = "the tag argument"
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            return root if is_foreign(root) else None  # a DCP folder, or a DeepSpeed tag folder itself
        confined_path(root, "latest", latest)
        tag, source = _read_latest(latest), latest
    path = confined_path(root, str(tag), source)
    if not path.is_dir() and (root / f".{tag}.old").is_dir():
        path = confined_path(root, f".{tag}.old", source)  # a save overwriting this tag stopped between renames
    if not path.is_dir():
        named = f"{source}: names tag {tag!r}, but " if tag is not None and source != "the tag argument" else ""
        raise CheckpointError(f"{named}{root / str(tag)}: no such checkpoint (tags here: "
                              f"{sorted(p.name for p in root.iterdir() if p.is_dir())})")
    return path


def read_metadata(path: Path) -> dict:
    """``path/metadata.json``, validated against the schema (validate.py); for a DeepSpeed or DCP
    folder, the metadata it maps to (formats.py: its files are read and checked to build it)."""
    return open_checkpoint(path)[0]


def _match(engine: CheckpointTarget, meta: dict, strict: bool, source: Path) -> tuple[set[str], set[str]]:
    """Match saved names to the model: returns (trainable names absent from the checkpoint, untrained
    names absent from it: buffers, frozen parameters). A shape mismatch is always refused; a missing
    or unexpected name too under ``strict`` (else it is reported and the live value kept). Frozen
    parameters the checkpoint lists as excluded keep their live values and are never missing."""
    tensors, extras = meta["tensors"], saved_extras(meta)
    tidx, xidx = saved_index(tensors), saved_index(extras)
    live_x = {**module_extras(engine), **{n: p for g in frozen_groups(engine)
                                          for n, p in zip(g.names, g.params, strict=True)}}
    wrong: list[str] = []
    miss_t: set[str] = set()
    live_t: set[str] = set()

    def compare(name: str, entry: dict, t: torch.Tensor, shape: list[int]) -> None:
        here = logical_shape_of(shape, spec_of(t))
        if logical_shape(entry) != here:
            wrong.append(f"{name} (shape {logical_shape(entry)} saved, {here} here)")
        elif not dtype_from_name(entry["dtype"]).is_floating_point and dtype_from_name(entry["dtype"]) != t.dtype:
            wrong.append(f"{name} (dtype {entry['dtype']} saved, {dtype_name(t.dtype)} here)")

    for g in engine.groups:
        for name, p in zip(g.names, g.params, strict=True):
            live_t.add(name)
            if name not in tidx:
                miss_t.add(name)
            else:
                compare(name, tensors[tidx[name][0]], p, saved_shape(p))
    excluded = set(meta["excluded_frozen"])
    miss_x = {n for n in live_x if n not in xidx}
    for name in set(live_x) & set(xidx):
        compare(name, extras[xidx[name][0]], live_x[name], full_shape(live_x[name]))
    unexpected = sorted((set(tidx) - live_t) | (set(xidx) - set(live_x)))
    if getattr(engine, "holds_one_stage", False):  # a pipeline stage: the other stages' tensors are theirs
        unexpected = []
    missing = sorted(miss_t | (miss_x - excluded))
    if wrong:
        raise CheckpointError(f"{source}: does not fit this model: size mismatch {wrong[:5]}"
                              f"{'...' if len(wrong) > 5 else ''}")
    if missing or unexpected:
        crossed = sorted(set(missing) & set(unexpected))  # trained when saved, frozen here (or the reverse)
        what = (f"missing {missing[:5]}{'...' if len(missing) > 5 else ''} ({len(missing)}), unexpected "
                f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''} ({len(unexpected)})"
                + (f"; {crossed[:3]} changed between trainable and frozen" if crossed else ""))
        if strict:
            raise CheckpointError(f"{source}: does not match this model: {what}; pass "
                                  "load_module_strict=False to load the matching names only")
        log.warning(f"{source}: load_module_strict=False: {what}; those keep their current values")
    return miss_t, miss_x


def read_saved(reader: ShardReader, tensors: dict, prefix: str, key: str, dtype: torch.dtype,
               stored: torch.dtype | None = None) -> torch.Tensor:
    """The whole saved tensor ``prefix/key`` (a trainable one's local TP piece), in its saved shape
    (``stored``: the file's dtype when metadata.json says it is not ``dtype``; the read converts)."""
    info = tensors[key]
    buf = torch.empty(info["numel"], dtype=dtype)
    reader.read_range(f"{prefix}/{key}", info["segments"], 0, info["numel"], buf, stored)
    return buf.view(info["shape"])


def _current_state(engine: CheckpointTarget, g, k: str) -> torch.Tensor | None:
    v = engine.optimizer.state.get(g.master, {}).get(k)
    return v if torch.is_tensor(v) and v.shape == g.master.shape else None


def _read_own(engine: CheckpointTarget, meta: dict, reader: ShardReader, states: list[str],
              skip: set[str]) -> list[dict]:
    """Per group: {"bufs": {"master": tensor, state: tensor, ...}, "scalars": {...}} for this rank's range.

    A parameter saved with this rank's TP split is read by element range; one saved at another TP
    degree is rebuilt whole (its overlapping TP pieces read) and then cut to this rank's range.
    Names in ``skip`` (absent, load_module_strict=False) keep their current values.
    """
    tensors, out = meta["tensors"], []
    index = saved_index(tensors)
    # each read in the dtype this engine keeps (a bf16 master run resumed with fp32 masters and back)
    stored = {"master": dtype_from_name(meta.get("master_dtype", "float32")),
              **{k: dtype_from_name(meta["state_dtypes"][k]) for k in states}}
    for g in engine.groups:
        bufs = {"master": master_buffer(g, stored["master"])}
        for k in states:
            cur = _current_state(engine, g, k)
            kept = cur.dtype if cur is not None else kept_state_dtype(g, k)
            if kept is None:
                continue  # a Kahan compensation this group does not keep
            fresh = None if cur is not None else torch.zeros(g.own_numel, dtype=kept, device=g.master.device)
            bufs[k] = cur.detach().clone() if cur is not None else fresh
        first = None  # the scalars (Adam's step) of the first parameter this rank holds part of
        for seg in g.owned:
            name, p = g.names[seg.index], g.params[seg.index]
            if name in skip:
                continue
            spec = spec_of(p)
            key = direct_key(name, spec, tensors)
            first = first or key or index[name][0]
            for k, buf in bufs.items():
                dst = buf.narrow(0, seg.offset, seg.length)
                if key is not None:  # (an expert's slice: its range of the full tensor)
                    off = saved_offset(p)
                    reader.read_range(f"{k}/{key}", tensors[key]["segments"], seg.start + off, seg.stop + off, dst,
                                      stored[k])
                    continue
                local = torch.zeros(full_shape(p), dtype=buf.dtype)
                rebuild(name, local, spec, index[name], tensors,
                        lambda s, k=k, dt=buf.dtype: read_saved(reader, tensors, k, s, dt, stored[k]))
                dst.copy_(local.view(-1)[seg.start:seg.stop])
        settle_master(g, bufs, bool(states))  # fp32 into a Kahan bf16 master: the residual kept
        scal = meta["scalars"].get(first, {}) if states and first else {}
        out.append({"bufs": bufs, "scalars": scal})
    return out


def _read_module(engine: CheckpointTarget, meta: dict, reader: ShardReader, skip: set[str]) -> dict[str, torch.Tensor]:
    """Buffers and unsharded frozen parameters, whole or as this rank's TP piece (resharded if saved
    otherwise), from the ``module`` or ``frozen`` section."""
    live, saved = module_extras(engine), saved_extras(meta)
    index = saved_index(saved)
    out = {}
    for name, t in live.items():
        if name in skip:
            continue
        spec, keys = spec_of(t), index[name]
        key = direct_key(name, spec, saved)
        if key is not None:
            out[name] = read_whole(reader, saved, key)
            continue
        out[name] = rebuild(name, torch.zeros(t.shape, dtype=dtype_from_name(saved[keys[0]]["dtype"])),
                            spec, keys, saved, lambda s: read_whole(reader, saved, s))
    return out


def _stage_optimizer(engine: CheckpointTarget, meta: dict, loaded: list[dict], source: Path) -> dict:
    """The torch optimizer state_dict to install, every saved value checked against the live one.

    torch then applies its own dtype/device rules (``step`` on CPU unless fused/capturable).
    """
    opt = engine.optimizer
    sd = opt.state_dict()
    if len(sd["param_groups"]) != len(meta["param_groups"]):
        raise CheckpointError(f"{source}: {len(meta['param_groups'])} optimizer param groups saved, this "
                              f"engine has {len(sd['param_groups'])}")
    groups = []
    for i, (cur, saved) in enumerate(zip(sd["param_groups"], meta["param_groups"], strict=True)):
        if "lr" not in saved:
            raise CheckpointError(f"{source}: param_groups[{i}] has no 'lr'")
        g = dict(cur)
        for k, v in saved.items():
            if k in cur and k not in IMPL_KEYS and k != "params":
                match_like(cur[k], v, f"param_groups[{i}][{k!r}]", source)
                g[k] = like(cur[k], v)
        groups.append(g)
    index = {}
    for pg_live, pg_sd in zip(opt.param_groups, sd["param_groups"], strict=True):
        index.update({id(p): i for p, i in zip(pg_live["params"], pg_sd["params"], strict=True)})
    state: dict[int, dict[str, Any]] = {}
    for g, got in zip(engine.groups, loaded, strict=True):
        # (each state was read into the dtype this engine keeps it in: _read_own, zero/low_precision.py)
        live = {k for k in opt.state.get(g.master, {}) if k != COMPENSATION}
        if live and live != {k for k in meta["states"] if k != COMPENSATION} | set(got["scalars"]):
            raise CheckpointError(f"{source}: saved optimizer state {sorted(meta['states'])} + scalars "
                                  f"{sorted(got['scalars'])} is not this optimizer's {sorted(live)}")
        if meta["states"]:
            st: dict[str, Any] = {k: v for k, v in got["bufs"].items() if k != "master"}
            for k, sc in got["scalars"].items():
                st[k] = sc["value"] if sc["dtype"] is None else torch.tensor(
                    sc["value"], dtype=dtype_from_name(sc["dtype"]))
            state[index[id(g.master)]] = st
    return {"state": state, "param_groups": groups}


def _install_optimizer(engine: CheckpointTarget, sd: dict, path: Path) -> None:
    """``load_state_dict``, undone if torch refuses the state (a check the staging missed)."""
    opt = engine.optimizer
    old = opt.state_dict()  # references the live state tensors, which load_state_dict replaces
    try:
        opt.load_state_dict(sd)
    except Exception as e:  # noqa: BLE001
        opt.load_state_dict(old)
        raise CheckpointError(f"{path / 'metadata.json'}: the optimizer refused the saved state "
                              f"({type(e).__name__}: {e}); parameters were loaded, optimizer state kept") from e


@dataclass
class _Staged:
    """Everything a load installs, read and checked; installing it cannot fail."""

    masters: list[torch.Tensor] = field(default_factory=list)
    module: dict[str, torch.Tensor] = field(default_factory=dict)
    frozen: list[tuple[Any, torch.Tensor]] = field(default_factory=list)  # (stage-3 frozen group, new shard)
    optimizer: dict | None = None
    scheduler: dict | None = None
    scaler: dict | None = None
    rng: Callable[[], None] | None = None


def _stage(engine: CheckpointTarget, path: Path, meta: dict, reader: ShardReader, strict: bool, with_opt: bool,
           with_sched: bool, module_only: bool, rank: int, world: int) -> _Staged:
    source = path / "metadata.json" if (path / "metadata.json").exists() else path
    skip_t, skip_m = _match(engine, meta, strict, source)
    if with_opt and not module_only:
        check_foreign_optimizer(engine, meta, source)
    if with_opt:
        check_state_layout(engine, meta, source)  # flat vs whole-tensor state: refused by name
    loaded = _read_own(engine, meta, reader, meta["states"] if with_opt else [], skip_t)
    st = _Staged(masters=[got["bufs"]["master"] for got in loaded],
                 module=_read_module(engine, meta, reader, skip_m),
                 frozen=read_frozen_shards(engine, meta, reader, skip_m))
    reader.release()
    if module_only:
        return st
    if with_opt:
        st.optimizer = _stage_optimizer(engine, meta, loaded, source)
        stage_whole_state(engine, meta, reader, st.optimizer, source, skip_t)
    if with_sched and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        live = engine.lr_scheduler.state_dict()
        st.scheduler = adapt_scheduler(live, meta["lr_scheduler"], meta)
        match_like(live, st.scheduler, "lr_scheduler", source)
    if engine.loss_scaler is not None and meta["loss_scaler"] is not None:
        match_like(engine.loss_scaler.state_dict(), meta["loss_scaler"], "loss_scaler", source)
        st.scaler = meta["loss_scaler"]
    lay = meta["layout"]  # per-rank streams only mean something in the same layout
    if lay["world"] == world and lay["tp"] == engine.tp.size and meta["rng"]:  # foreign formats save none
        st.rng = rng_setter(meta["rng"][rank], source)
    return st


def load_checkpoint(engine: CheckpointTarget, load_dir: str | Path, tag: str | None = None,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, verify: bool = True,
                    load_module_strict: bool = True) -> tuple[str | None, dict | None]:
    """Load ``load_dir/tag`` (default: the tag in ``latest``); returns ``(path, client_state)``.

    Collective and all-or-nothing: on any problem every rank raises the same
    :class:`CheckpointError` naming the file, and the engine is unchanged. As DeepSpeed, returns
    ``(None, None)`` with a warning when ``tag`` is None and there is no ``latest`` file.
    ``verify=False`` skips the sha256 pass (sizes are still checked). ``load_module_strict=False``
    loads the names the model and checkpoint share (shapes must still match) and logs the rest.
    """
    async_save.complete(block=True)  # a pending asynchronous save is published (or fails) first
    comm, _ = world_comm(), engine.wait_for_params()  # the last step's all-gathers may still write the params
    with_opt = load_optimizer_states and not load_module_only and engine.optimizer is not None
    err, path, meta, st = None, None, {}, _Staged()
    try:
        path = resolve_tag(load_dir, tag)
        if path is not None:
            meta, reader = open_checkpoint(path, verify)
            with hashed_ahead(engine, meta, reader):  # the files hashed meanwhile, checked before agreeing
                st = _stage(engine, path, meta, reader, load_module_strict, with_opt, load_lr_scheduler_states,
                            load_module_only, comm.rank, comm.size)
    except CheckpointError as e:
        err = e
    except Exception as e:  # noqa: BLE001 - anything else a damaged file provokes, named
        err = CheckpointError(f"{path or load_dir}: cannot load ({type(e).__name__}: {e})"[:1000])
        err.__cause__ = e
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt: peers must not hang either
        err = e
    agree(comm, err, f"load_checkpoint({load_dir})")
    if path is None:
        log.warning(f"no 'latest' file in {load_dir}: nothing loaded (pass tag= to pick a checkpoint)")
        return None, None
    live = module_extras(engine) if st.module else {}
    with torch.no_grad():
        for g, master in zip(engine.groups, st.masters, strict=True):
            g.master_writable()  # no copy out of a pinned master still reads it
            g.master.copy_(master)
        for g in engine.groups:
            g.publish_master()
        for name, t in st.module.items():
            live[name].data.copy_(t)
        install_frozen_shards(st.frozen)
    if load_module_only:
        return str(path), meta["client_state"]
    if st.optimizer is not None:
        _install_optimizer(engine, st.optimizer, path)
    if st.scheduler is not None:
        engine.lr_scheduler.load_state_dict(st.scheduler)
    if st.scaler is not None:
        engine.loss_scaler.load_state_dict(st.scaler)
    c = meta["counters"]
    # Partial accumulations are not saved, so the loaded engine starts at a boundary of its own
    # accumulation count (the saved micro_steps count another layout's gas when the world changed).
    engine.global_steps, engine.micro_steps = c["global_steps"], c["global_steps"] * engine.gas
    engine.skipped_steps = c["skipped_steps"]
    if st.rng is not None:
        st.rng()
    return str(path), meta["client_state"]
