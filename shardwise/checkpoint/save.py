"""Sharded save: each rank writes the state it owns, described independently of the layout.

Every saved piece is "elements [a, b) of the flattened saved tensor KEY", where KEY is a parameter's
name, or ``NAME@tp{r}of{t}`` for TP rank r's local tensor of a TP-sharded parameter (see
``checkpoint/tp.py``), so a loader with any world size, stage, bucketing or TP degree finds the
slices it needs from the metadata alone. See docs/checkpoints.md for the format.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardwise.checkpoint.experts import (
    refuse_frozen_experts,
    saved_numel,
    saved_offset,
    saved_shape,
    writes_group,
)
from shardwise.checkpoint.fileio import (
    FORMAT,
    VERSION,
    CheckpointError,
    SafetensorsWriter,
    agree,
    dtype_name,
    rng_state,
    to_json,
    world_comm,
)
from shardwise.checkpoint.frozen import describe_frozen, module_extras
from shardwise.checkpoint.recovery import write_recovery_script
from shardwise.checkpoint.tp import logical_name, saved_name, spec_of, tp_meta
from shardwise.checkpoint.whole_tensor_state import SECTION, merge_whole_state, whole_state_pieces
from shardwise.files.safe import finite_json, plain_name, write_atomic

if TYPE_CHECKING:
    from shardwise.checkpoint.target import CheckpointTarget

# optimizer param_group keys that pick a kernel, not a hyperparameter: the loading side keeps its own
IMPL_KEYS = frozenset({"fused", "foreach", "capturable", "differentiable"})


def _after_file_written(path: Path) -> None:
    """Test seam: called after each shard file is complete (tests raise here to simulate a crash)."""


def _rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def _split_state(g, state: dict) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Optimizer state of one master: per-element tensors, and scalars (Adam's ``step``)."""
    elem, scalars = {}, {}
    for k, v in state.items():
        if torch.is_tensor(v) and v.shape == g.master.shape:  # step has shape ()
            elem[k] = v
        elif torch.is_tensor(v) and v.numel() == 1:
            scalars[k] = {"value": v.item(), "dtype": dtype_name(v.dtype)}
        elif isinstance(v, bool | int | float):
            scalars[k] = {"value": v, "dtype": None}
        else:
            raise TypeError(f"optimizer state {k!r} ({type(v).__name__}) is neither per-element nor a "
                            "scalar; the checkpoint format cannot shard it")
    return elem, scalars


def _write_rank(engine: CheckpointTarget, folder: Path, rank: int, exclude_frozen: bool = False) -> dict:
    """Write this rank's shard file; returns its manifest (merged into metadata.json by rank 0).

    Under TP, TP-sharded parameters are saved per TP rank under ``NAME@tp{r}of{t}``; replicated ones
    only by TP rank 0 (of each data-parallel group, which tiles them with its ZeRO shards). Frozen
    parameters: see ``checkpoint/frozen.py``.
    """
    # stage 0: replicated, dp rank 0 writes; hybrid sharding: the first replica writes its shards
    if not exclude_frozen:
        refuse_frozen_experts(engine.module)
    first_replica = engine.replica.rank == 0
    writes = first_replica and (engine.policy.shard_optimizer or engine.comm.rank == 0)
    tp_rank = engine.tp.rank if engine.tp.size > 1 else 0
    pieces: list[tuple[str, torch.Tensor]] = []
    tensors: dict[str, dict] = {}
    segments: dict[str, list[int]] = {}
    scalars: dict[str, dict] = {}
    state_dtypes: dict[str, str] = {}
    for g in engine.groups:
        state = engine.optimizer.state.get(g.master, {}) if engine.optimizer is not None else {}  # None: eval engine
        writes_g = writes_group(g, engine.policy.shard_optimizer, first_replica, engine.comm.rank)
        elem, sc = _split_state(g, state) if writes_g else ({}, {})
        state_dtypes.update({k: dtype_name(v.dtype) for k, v in elem.items()})
        own = {s.index: s for s in g.owned}
        for i, (name, p) in enumerate(zip(g.names, g.params, strict=True)):
            spec = spec_of(p)
            if spec is None and tp_rank != 0:
                continue  # replicated over TP: TP rank 0 saves it
            key, shape = saved_name(name, spec), saved_shape(p)  # experts: the full tensor (checkpoint/experts.py)
            tensors[key] = {"shape": shape, "numel": saved_numel(p), "dtype": dtype_name(g.dtype),
                            "tp": tp_meta(name, spec, shape), "segments": []}
            seg = own.get(i)
            if not writes_g or seg is None:
                continue
            off = saved_offset(p)
            segments[key] = [seg.start + off, seg.stop + off]
            scalars[key] = sc
            pieces.append((f"master/{key}", g.master.narrow(0, seg.offset, seg.length)))
            pieces += [(f"{k}/{key}", v.narrow(0, seg.offset, seg.length)) for k, v in elem.items()]
    whole_writes = engine.comm.rank == 0 and first_replica  # unsharded: dp rank 0 (TP pieces per TP rank)
    frozen, frozen_segs, frozen_pieces, excluded = describe_frozen(engine, first_replica, whole_writes, tp_rank,
                                                                   exclude_frozen)
    pieces += frozen_pieces
    whole_pieces, whole_state = whole_state_pieces(engine, writes)  # non-elementwise optimizers
    pieces += whole_pieces
    module = _buffer_entries(engine, tp_rank, pieces) if whole_writes else {}
    manifest: dict[str, Any] = {"rank": rank, "file": None, "tensors": tensors, "segments": segments,
                                "scalars": scalars, "state_dtypes": state_dtypes, "module": module,
                                "frozen": frozen, "frozen_segments": frozen_segs, "excluded_frozen": excluded,
                                "rng": rng_state(), SECTION: whole_state}
    if pieces:
        manifest.update(_write_pieces(folder, _rank_file(rank), pieces))
    return manifest


def _buffer_entries(engine: CheckpointTarget, tp_rank: int, pieces: list[tuple[str, torch.Tensor]]) -> dict:
    """The persistent buffers' metadata, their tensors appended to ``pieces`` (TP slices per TP rank,
    replicated ones by TP rank 0)."""
    module: dict[str, dict] = {}
    for name, t in module_extras(engine, params=False).items():
        spec = spec_of(t)
        if spec is None and tp_rank != 0:
            continue
        key = saved_name(name, spec)
        module[key] = {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "tp": tp_meta(name, spec, list(t.shape))}
        pieces.append((f"module/{key}", t.detach()))
    return module


def _write_pieces(folder: Path, fname: str, pieces: list[tuple[str, torch.Tensor]]) -> dict:
    """One safetensors file of ``pieces``; its manifest fields (file, sha256, bytes)."""
    w = SafetensorsWriter(folder / fname, [(k, t.dtype, tuple(t.shape)) for k, t in pieces])
    for k, t in pieces:
        w.write(k, t)
    sha, size = w.close()
    _after_file_written(folder / fname)
    return {"file": fname, "sha256": sha, "bytes": size}


def model_config(module: torch.nn.Module) -> dict | None:
    """The HF config as JSON, with ``architectures`` filled so from_pretrained picks the class."""
    cfg = getattr(module, "config", None)
    if cfg is None or not hasattr(cfg, "to_json_string"):
        return None
    d = json.loads(cfg.to_json_string(use_diff=False))
    d["architectures"] = [type(module).__name__]
    return d


def _merge_segmented(manifests: list[dict], entries: str, segments: str) -> dict[str, dict]:
    """One section of segment-saved tensors from every rank's manifest; the segments must tile each."""
    out: dict[str, dict] = {}
    for m in manifests:  # every rank describes its saved names (TP ranks have different ones)
        for key, t in m[entries].items():
            if key in out and out[key]["shape"] != t["shape"]:
                raise AssertionError(f"{key}: ranks disagree on its shape ({out[key]['shape']} "
                                     f"and {t['shape']})")
            out.setdefault(key, t)
    for m in manifests:
        for name, (a, b) in m[segments].items():
            out[name]["segments"].append({"file": m["file"], "start": a, "stop": b})
    for name, t in out.items():  # the shards must tile every parameter exactly
        t["segments"].sort(key=lambda s: s["start"])
        pos = 0
        for s in t["segments"]:
            assert s["start"] == pos, f"{name}: segments leave a gap at {pos}"
            pos = s["stop"]
        assert pos == t["numel"], f"{name}: segments cover {pos} of {t['numel']} elements"
    return out


def _metadata(engine: CheckpointTarget, manifests: list[dict], world: int, client_state: dict) -> dict:
    tensors = _merge_segmented(manifests, "tensors", "segments")
    frozen = _merge_segmented(manifests, "frozen", "frozen_segments")
    files, scalars, module, state_dtypes = {}, {}, {}, {}
    for m in manifests:
        if m["file"] is not None:
            files[m["file"]] = {"sha256": m["sha256"], "bytes": m["bytes"]}
        scalars.update(m["scalars"])
        state_dtypes.update(m["state_dtypes"])
        module.update({k: {**v, "file": m["file"]} for k, v in m["module"].items()})
    saved = {logical_name(k, v) for sec in (tensors, module, frozen) for k, v in sec.items()}
    order = [n for n, _ in engine.module.named_parameters() if n in saved]
    order += [n for n in dict.fromkeys(logical_name(k, v) for k, v in module.items()) if n not in order]
    # pipeline stages: rank 0 holds the first stage's parameters only; the others follow in rank order
    order += [n for n in dict.fromkeys(logical_name(k, v) for sec in (tensors, frozen) for k, v in sec.items())
              if n not in order]
    opt = engine.optimizer
    sched = engine.lr_scheduler
    return {
        "format": FORMAT, "version": VERSION,
        "layout": {"world": world, "dp": engine.dp_world, "tp": engine.tp.size,
                   "stage": engine.stage, "compute_dtype": dtype_name(engine.groups[0].dtype)
                   if engine.groups else None},
        "order": order,
        "tensors": tensors,
        "states": sorted(state_dtypes),
        "state_dtypes": state_dtypes,
        "scalars": scalars,
        "module": module,
        "frozen": frozen,
        "excluded_frozen": sorted({n for m in manifests for n in m["excluded_frozen"]}),
        "files": files,
        "param_groups": [to_json({k: v for k, v in pg.items() if k != "params" and k not in IMPL_KEYS},
                                 f"optimizer.param_groups[{i}]")
                         for i, pg in enumerate(opt.param_groups if opt is not None else [])],
        "lr_scheduler": to_json(sched.state_dict(), "lr_scheduler.state_dict()") if sched else None,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "counters": {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                     "skipped_steps": engine.skipped_steps},
        "rng": [m["rng"] for m in manifests],
        "client_state": client_state,
        "has_model_config": model_config(engine.module) is not None,
        "tied": _tied_names(engine.module, saved),
        SECTION: merge_whole_state(engine, manifests),
        **_master_dtype(engine),
    }


def _master_dtype(engine: CheckpointTarget) -> dict[str, str]:
    """``{"master_dtype": ...}`` when the masters are bf16/fp16 (zero/low_precision.py); one dtype per model."""
    dtypes = {dtype_name(g.master.dtype) for g in engine.groups if g.master is not None}
    if len(dtypes) > 1:
        raise CheckpointError(f"masters of several dtypes ({sorted(dtypes)}): the format keeps one master dtype")
    return {"master_dtype": dtypes.pop()} if dtypes and dtypes != {"float32"} else {}


def _tied_names(module: torch.nn.Module, saved: set[str]) -> dict[str, str]:
    """``{alias: saved name}`` of parameters shared under several names (saved once), so offline
    readers (zero_to_fp32) can give the state dict every name the model has."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first and first[id(p)] in saved and name != first[id(p)]:
            tied[name] = first[id(p)]
        first.setdefault(id(p), name)
    return tied


def _finalize(engine: CheckpointTarget, root: Path, tmp: Path, tag: str, world: int, client_state: dict,
              save_latest: bool) -> None:
    """Rank 0: merge the rank manifests, then rename the folder into place and update ``latest``."""
    from shardwise.checkpoint.fileio import read_json, write_json

    manifests = [read_json(tmp / f"rank{r:05d}.json") for r in range(world)]
    write_json(tmp / "metadata.json", _metadata(engine, manifests, world, client_state))
    cfg = model_config(engine.module)
    if cfg is not None:
        write_json(tmp / "config.json", cfg)
    for r in range(world):
        (tmp / f"rank{r:05d}.json").unlink()
    final, old = root / tag, root / f".{tag}.old"
    if final.exists():  # overwrite a tag: keep the old one until the new one is in place
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    if save_latest:  # written whole and fsynced, then renamed: `latest` is never partial
        write_atomic(root / "latest", tag.encode())
    write_recovery_script(root)  # zero_to_fp32.py next to `latest`, as DeepSpeed's (recovery.py)


def remove_stale_partials(root: Path) -> list[str]:
    """Delete the ``.TAG.partial`` folders that crashed saves left in ``root`` (any tag).

    Only rank 0 of a saving job calls it, before it creates its own; two jobs saving into one
    folder at the same time are not supported.
    """
    gone = []
    for p in root.glob(".*.partial"):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p.name)
        elif p.is_symlink():
            p.unlink()
            gone.append(p.name)
    return gone


def save_checkpoint(engine: CheckpointTarget, save_dir: str | Path, tag: str | None = None,
                    client_state: dict | None = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> str:
    """Write ``save_dir/tag`` (default ``global_step{N}``) from every rank; returns its path.

    Collective: every rank must call it. Files go to ``save_dir/.tag.partial`` first and the folder
    is renamed into place only once every rank's file and the metadata are on disk.
    ``exclude_frozen_parameters``: frozen parameters are not written, only listed as excluded
    (a load keeps the model's own values for them).
    """
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    if not plain_name(tag) or tag in ("latest", "latest.tmp"):
        raise ValueError(f"checkpoint tag {tag!r} must be a plain folder name (printable, no '/' or '\\', "
                         "no spaces at either end, not hidden)")
    client_state = finite_json(to_json(client_state or {}, "client_state"), "client_state")
    comm = world_comm()
    root = Path(save_dir)
    tmp = root / f".{tag}.partial"
    err: BaseException | None = None
    try:
        if comm.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            remove_stale_partials(root)  # left by earlier crashed saves, whatever their tag
            tmp.mkdir()
    except Exception as e:  # noqa: BLE001 - re-raised by agree() on every rank
        err = e
    agree(comm, err, "save_checkpoint (creating the folder)")
    err = None
    try:
        from shardwise.checkpoint.fileio import write_json

        manifest = _write_rank(engine, tmp, comm.rank, exclude_frozen_parameters)
        write_json(tmp / f"rank{comm.rank:05d}.json", manifest)
    except BaseException as e:  # noqa: BLE001
        err = e
    agree(comm, err, "save_checkpoint (writing shards)")
    err = None
    try:
        if comm.rank == 0:
            _finalize(engine, root, tmp, tag, comm.size, client_state, save_latest)
    except BaseException as e:  # noqa: BLE001
        err = e
    agree(comm, err, "save_checkpoint (writing metadata)")
    return str(root / tag)
