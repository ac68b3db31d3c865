"""A save's metadata and its publication: what rank 0 does once every rank's files are on disk.

The metadata is built from two parts: :func:`engine_meta`, everything it reads from the live engine
(layout, optimizer hyperparameters, scheduler, loss scaler, counters, the model's names and config),
taken at the save call; and the rank manifests the writers leave in the partial folder. A
synchronous save takes both at once; an asynchronous one (``checkpoint/async_save.py``) takes the
first at the call and publishes after training went on, so nothing here may read the engine later.
Publishing: ``metadata.json`` (fsynced), the partial folder renamed into place, the parent folder
fsynced, then ``latest`` (written whole, fsynced, renamed): ``latest`` never names a folder that is
not complete on disk.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardwise.checkpoint import shard_writer
from shardwise.checkpoint.fileio import FORMAT, VERSION, CheckpointError, dtype_name, read_json, to_json, write_json
from shardwise.checkpoint.recovery import write_recovery_script
from shardwise.checkpoint.tp import logical_name
from shardwise.checkpoint.whole_tensor_state import SECTION, merge_whole_state, whole_optimizer_name
from shardwise.files.safe import write_atomic

if TYPE_CHECKING:
    from shardwise.checkpoint.target import CheckpointTarget

# optimizer param_group keys that pick a kernel, not a hyperparameter: the loading side keeps its own
IMPL_KEYS = frozenset({"fused", "foreach", "capturable", "differentiable"})


def model_config(module: torch.nn.Module) -> dict | None:
    """The HF config as JSON, with ``architectures`` filled so from_pretrained picks the class."""
    cfg = getattr(module, "config", None)
    if cfg is None or not hasattr(cfg, "to_json_string"):
        return None
    d = json.loads(cfg.to_json_string(use_diff=False))
    d["architectures"] = [type(module).__name__]
    return d


def engine_meta(engine: CheckpointTarget, world: int) -> dict[str, Any]:
    """Everything the metadata reads from the engine, copied now (the engine trains on after an
    asynchronous save's call)."""
    opt, sched = engine.optimizer, engine.lr_scheduler
    first: dict[int, str] = {}
    aliases = []  # (alias, first name) of parameters shared under several names
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        if id(p) in first and name != first[id(p)]:
            aliases.append((name, first[id(p)]))
        first.setdefault(id(p), name)
    return {
        "layout": {"world": world, "dp": engine.dp_world, "tp": engine.tp.size, "stage": engine.stage,
                   "compute_dtype": dtype_name(engine.groups[0].dtype) if engine.groups else None},
        "names": [n for n, _ in engine.module.named_parameters()],
        "aliases": aliases,
        "param_groups": [to_json({k: v for k, v in pg.items() if k != "params" and k not in IMPL_KEYS},
                                 f"optimizer.param_groups[{i}]")
                         for i, pg in enumerate(opt.param_groups if opt is not None else [])],
        "lr_scheduler": to_json(sched.state_dict(), "lr_scheduler.state_dict()") if sched else None,
        "loss_scaler": copy.deepcopy(engine.loss_scaler.state_dict()) if engine.loss_scaler is not None else None,
        "counters": {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                     "skipped_steps": engine.skipped_steps},
        "model_config": model_config(engine.module),
        "whole_optimizer": whole_optimizer_name(engine),
        "master_dtype": _master_dtype(engine),
    }


def _master_dtype(engine: CheckpointTarget) -> dict[str, str]:
    """``{"master_dtype": ...}`` when the masters are bf16/fp16 (zero/low_precision.py); one dtype per model."""
    dtypes = {dtype_name(g.master.dtype) for g in engine.groups if g.master is not None}
    if len(dtypes) > 1:
        raise CheckpointError(f"masters of several dtypes ({sorted(dtypes)}): the format keeps one master dtype")
    return {"master_dtype": dtypes.pop()} if dtypes and dtypes != {"float32"} else {}


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


def metadata(meta: dict[str, Any], manifests: list[dict], client_state: dict) -> dict:
    """``metadata.json``: the engine's part (:func:`engine_meta`) and every rank's manifest."""
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
    order = [n for n in meta["names"] if n in saved]
    order += [n for n in dict.fromkeys(logical_name(k, v) for k, v in module.items()) if n not in order]
    # pipeline stages: rank 0 holds the first stage's parameters only; the others follow in rank order
    order += [n for n in dict.fromkeys(logical_name(k, v) for sec in (tensors, frozen) for k, v in sec.items())
              if n not in order]
    return {
        "format": FORMAT, "version": VERSION,
        "layout": meta["layout"],
        "order": order,
        "tensors": tensors,
        "states": sorted(state_dtypes),
        "state_dtypes": state_dtypes,
        "scalars": scalars,
        "module": module,
        "frozen": frozen,
        "excluded_frozen": sorted({n for m in manifests for n in m["excluded_frozen"]}),
        "files": files,
        "param_groups": meta["param_groups"],
        "lr_scheduler": meta["lr_scheduler"],
        "loss_scaler": meta["loss_scaler"],
        "counters": meta["counters"],
        "rng": [m["rng"] for m in manifests],
        "client_state": client_state,
        "has_model_config": meta["model_config"] is not None,
        "tied": {alias: name for alias, name in meta["aliases"] if name in saved},
        SECTION: merge_whole_state(meta["whole_optimizer"], manifests),
        **meta["master_dtype"],
    }


def fsync_dir(folder: Path) -> None:
    """Make the folder's entries (new files, renames) durable, not only the files' bytes."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finalize(meta: dict[str, Any], root: Path, tmp: Path, tag: str, client_state: dict, save_latest: bool) -> None:
    """Rank 0, once every rank's files are durable: merge the rank manifests, then rename the folder
    into place and update ``latest``."""
    world = meta["layout"]["world"]
    manifests = [read_json(tmp / f"rank{r:05d}.json") for r in range(world)]
    write_json(tmp / "metadata.json", metadata(meta, manifests, client_state))
    if meta["model_config"] is not None:
        write_json(tmp / "config.json", meta["model_config"])
    for r in range(world):
        (tmp / f"rank{r:05d}.json").unlink()
    fsync_dir(tmp)
    shard_writer.at_phase("publishing")
    final, old = root / tag, root / f".{tag}.old"
    if final.exists():  # overwrite a tag: keep the old one until the new one is in place
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    fsync_dir(root)  # the folder is in place on disk before `latest` names it
    shutil.rmtree(old, ignore_errors=True)
    if save_latest:  # written whole and fsynced, then renamed: `latest` is never partial
        write_atomic(root / "latest", tag.encode())
        fsync_dir(root)
    write_recovery_script(root)  # zero_to_fp32.py next to `latest`, as DeepSpeed's (recovery.py)


def remove_stale_partials(root: Path) -> list[str]:
    """Delete the ``.TAG.partial`` folders that crashed saves left in ``root`` (any tag).

    Only rank 0 of a saving job calls it, before it creates its own (after any save still pending
    was published: one save in flight at a time); two jobs saving into one folder at the same time
    are not supported.
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
