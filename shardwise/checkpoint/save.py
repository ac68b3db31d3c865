"""Sharded save: each rank writes the state it owns, described independently of the layout.

Every saved piece is "elements [a, b) of the flattened saved tensor KEY", where KEY is a parameter's
name, or ``NAME@tp{r}of{t}`` for TP rank r's local tensor of a TP-sharded parameter (see
``checkpoint/tp.py``), so a loader with any world size, stage, bucketing or TP degree finds the
slices it needs from the metadata alone. See docs/checkpoints.md for the format.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardwise.checkpoint import async_save, shard_writer
from shardwise.checkpoint.deferred import Deferred
from shardwise.checkpoint.experts import (
    refuse_frozen_experts,
    saved_numel,
    saved_offset,
    saved_shape,
    writes_group,
)
from shardwise.checkpoint.fileio import agree, dtype_name, rng_state, to_json, world_comm, write_json
from shardwise.checkpoint.frozen import describe_frozen, module_extras
from shardwise.checkpoint.publish import engine_meta, finalize, fsync_dir, remove_stale_partials
from shardwise.checkpoint.staging import stage
from shardwise.checkpoint.tp import saved_name, spec_of, tp_meta
from shardwise.checkpoint.whole_tensor_state import SECTION, whole_state_pieces
from shardwise.files.safe import finite_json, plain_name

if TYPE_CHECKING:
    from shardwise.checkpoint.target import CheckpointTarget




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


def _rank_pieces(engine: CheckpointTarget, rank: int, exclude_frozen: bool = False) -> tuple[dict, list]:
    """This rank's manifest (merged into metadata.json by rank 0; its file fields filled in when the
    file is written) and the pieces of its shard file (views of the live state).

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
    copies = getattr(engine, "copies_not_saved", frozenset())  # a pipeline stage's copies of tied weights
    for g in engine.groups:
        state = engine.optimizer.state.get(g.master, {}) if engine.optimizer is not None else {}  # None: eval engine
        writes_g = writes_group(g, engine.policy.shard_optimizer, first_replica, engine.comm.rank)
        elem, sc = _split_state(g, state) if writes_g else ({}, {})
        state_dtypes.update({k: dtype_name(v.dtype) for k, v in elem.items()})
        own = {s.index: s for s in g.owned}
        for i, (name, p) in enumerate(zip(g.names, g.params, strict=True)):
            spec = spec_of(p)
            if name in copies or (spec is None and tp_rank != 0):
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
            pieces += _group_pieces(engine, g, key, seg, {"master": g.master, **elem})
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
    return manifest, pieces


def _group_pieces(engine: CheckpointTarget, g, key: str, seg, tensors: dict[str, torch.Tensor]) -> list[tuple]:
    """One parameter's segment of ``g``'s master and per-element state: views of the live tensors, or, for a
    group held in NVMe swap files (``engine.nvme``, during a save its ``streamed()``), deferred pieces its
    swapper reads a group at a time as the writer reaches them (``checkpoint/deferred.py``)."""
    swap = getattr(engine, "nvme", None)
    if swap is not None and swap.swapped(g):
        return [(f"{k}/{key}", Deferred(v.dtype, (seg.length,),
                                         functools.partial(swap.saved_slice, g, k, seg.offset, seg.length)))
                for k, v in tensors.items()]
    return [(f"{k}/{key}", v.narrow(0, seg.offset, seg.length)) for k, v in tensors.items()]


def write_rank(folder: Path, rank: int, manifest: dict, pieces: list[tuple[str, torch.Tensor]]) -> None:
    """This rank's shard file and manifest in ``folder``, durable (fsynced, and the folder's entries)."""
    if pieces:
        manifest = {**manifest, **_write_pieces(folder, _rank_file(rank), pieces)}
    write_json(folder / f"rank{rank:05d}.json", manifest)
    fsync_dir(folder)


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
    sha, size = shard_writer.write_shard(folder / fname, pieces)
    _after_file_written(folder / fname)
    return {"file": fname, "sha256": sha, "bytes": size}


def save_checkpoint(engine: CheckpointTarget, save_dir: str | Path, tag: str | None = None,
                    client_state: dict | None = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False, asynchronous: bool | None = None) -> str:
    """Write ``save_dir/tag`` (default ``global_step{N}``) from every rank; returns its path.

    Collective: every rank must call it. Files go to ``save_dir/.tag.partial`` first and the folder
    is renamed into place only once every rank's file and the metadata are on disk.
    ``exclude_frozen_parameters``: frozen parameters are not written, only listed as excluded
    (a load keeps the model's own values for them). ``asynchronous`` (None: the engine's config,
    ``async_save.async_enabled``): return once the state is copied; written in the background and
    published later (``checkpoint/async_save.py``), byte for byte what a synchronous save writes.
    """
    async_save.complete(block=True)  # one save in flight: the previous one is published first
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    if not plain_name(tag) or tag in ("latest", "latest.tmp"):
        raise ValueError(f"checkpoint tag {tag!r} must be a plain folder name (printable, no '/' or '\\', "
                         "no spaces at either end, not hidden)")
    client_state = finite_json(to_json(client_state or {}, "client_state"), "client_state")
    comm = world_comm()
    root = Path(save_dir)
    tmp = root / f".{tag}.partial"
    _make_partial(comm, root, tmp)
    background = async_save.async_enabled(engine) if asynchronous is None else asynchronous
    job = async_save.SaveJob(root, tmp, tag, comm.rank, {}, None, client_state, save_latest, write_rank, _publish)
    err: BaseException | None = None
    try:
        job.manifest, pieces = _rank_pieces(engine, comm.rank, exclude_frozen_parameters)
        job.meta = engine_meta(engine, comm.size) if comm.rank == 0 else None
        if background:
            shard_writer.at_phase("staging")
            staged = stage(pieces, keep=async_save.keep_buffer(engine) and async_save.writer_idle())
        else:
            write_rank(tmp, comm.rank, job.manifest, pieces)
    except BaseException as e:  # noqa: BLE001 - re-raised by agree() on every rank
        err = e
    agree(comm, err, "save_checkpoint (staging)" if background else "save_checkpoint (writing shards)")
    if background:
        async_save.start(job, staged)
        return str(root / tag)
    err = None
    try:
        if comm.rank == 0:
            _publish(job)
    except BaseException as e:  # noqa: BLE001
        err = e
    agree(comm, err, "save_checkpoint (writing metadata)")
    return str(root / tag)


def _make_partial(comm, root: Path, tmp: Path) -> None:
    """Rank 0 creates ``root`` and the save's partial folder, after removing crashed saves' ones."""
    err: BaseException | None = None
    try:
        if comm.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            remove_stale_partials(root)  # left by earlier crashed saves, whatever their tag
            tmp.mkdir()
    except Exception as e:  # noqa: BLE001 - re-raised by agree() on every rank
        err = e
    agree(comm, err, "save_checkpoint (creating the folder)")


def _publish(job: async_save.SaveJob) -> None:
    """Rank 0: metadata.json, the folder renamed into place, then ``latest`` (checkpoint/publish.py)."""
    finalize(job.meta, job.root, job.tmp, job.tag, job.client_state, job.save_latest)
