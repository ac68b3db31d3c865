"""HF-format weights: offline consolidation of a sharded checkpoint, and export from a live engine.

Both stream one tensor at a time into planned safetensors files, so peak memory is about the
largest tensor (plus its cast copy), never the model: DeepSpeed's zero_to_fp32 assembles the
whole state dict in RAM instead.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shardwise.checkpoint.experts import gather_experts, refuse_frozen_experts, saved_shape
from shardwise.checkpoint.fileio import (
    CheckpointError,
    ShardReader,
    agree,
    dtype_from_name,
    dtype_name,
    read_json,
    world_comm,
    write_json,
)
from shardwise.checkpoint.formats import FOREIGN, open_checkpoint
from shardwise.checkpoint.frozen import frozen_groups, full_shape, module_extras, read_whole, saved_extras
from shardwise.checkpoint.load import read_saved, resolve_tag
from shardwise.checkpoint.publish import model_config
from shardwise.checkpoint.run_files import checkpoints_folder, copy_side_files, find_side_files
from shardwise.checkpoint.shard_writer import safetensors_writer
from shardwise.checkpoint.tp import logical_shape, logical_shape_of, rebuild, saved_index, spec_of
from shardwise.checkpoint.validate import confined_path
from shardwise.comm import Comm, CommStats
from shardwise.estimate.memory import parse_bytes
from shardwise.files.model_folder import hf_output_name
from shardwise.files.safe import OutputFolder, commit_temp, temp_of
from shardwise.tensor_parallel.plan import gather_full

if TYPE_CHECKING:
    from shardwise.checkpoint.target import CheckpointTarget

Spec = tuple[str, torch.dtype, tuple[int, ...]]


def _nbytes(spec: Spec) -> int:
    n = 1
    for s in spec[2]:
        n *= s
    return n * torch.empty((), dtype=spec[1]).element_size()


class ShardedHFWriter:
    """``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + index, written in spec order."""

    def __init__(self, out_dir: Path, specs: list[Spec], max_shard_size: int, guard: OutputFolder | None = None):
        # the API (save_16bit_model) replaces HF weight files like DeepSpeed's; the CLI passes its own guard
        self.guard = guard or OutputFolder(out_dir, "save_dir", overwrite=True, ours=hf_output_name)
        self.out = self.guard.prepare()
        shards: list[list[Spec]] = [[]]
        size = 0
        for spec in specs:
            if shards[-1] and size + _nbytes(spec) > max_shard_size:
                shards.append([])
                size = 0
            shards[-1].append(spec)
            size += _nbytes(spec)
        n = len(shards)
        self.names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                                           for i in range(n)]
        self.shards, self.total = shards, sum(_nbytes(s) for s in specs)
        self._i, self._j, self._w = 0, 0, None

    def write(self, name: str, t: torch.Tensor) -> None:
        if self._w is None:  # written to a hidden temporary name, renamed when complete
            self._w = safetensors_writer(temp_of(self.out / self.names[self._i]), self.shards[self._i])
        self._w.write(name, t)
        self._j += 1
        if self._j == len(self.shards[self._i]):
            self._w.close()
            commit_temp(self.out / self.names[self._i])
            self._w, self._i, self._j = None, self._i + 1, 0

    def close(self) -> list[str]:
        if len(self.names) > 1:
            wm = {s[0]: f for f, shard in zip(self.names, self.shards, strict=True) for s in shard}
            write_json(self.out / "model.safetensors.index.json",
                       {"metadata": {"total_size": self.total}, "weight_map": wm})
        return self.names

    def finish(self, config_written: bool, side_files: list[str] | tuple[str, ...] = ()) -> None:
        """Record the files written as ours; remove our stale ones (old shards would shadow them)."""
        index = ["model.safetensors.index.json"] if len(self.names) > 1 else []
        self.guard.finish([*self.names, *index, *(["config.json"] if config_written else []), *side_files])



def _write_config(cfg: dict | None, out: Path, dtype: torch.dtype) -> bool:
    if cfg is None:
        return False
    cfg = dict(cfg)
    keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]
    for k in keys:
        cfg[k] = dtype_name(dtype)
    write_json(out / "config.json", cfg)
    return True


def _model_config_for(root: Path, path: Path, meta: dict, config: str | Path | None,
                      weights_only: bool) -> dict | None:
    """The HF config to write next to the weights, checked before anything is written.

    ``from_pretrained`` needs ``config.json``: a checkpoint without one is refused unless the
    caller gives ``config`` (a config.json path) or asks for ``weights_only``. ``root`` is the
    folder the caller gave, ``path`` the tag folder in it: the HF Trainer keeps ``config.json`` in
    ``checkpoint-N/`` beside ``global_stepN/``, which is read only when ``checkpoint-N`` is the
    folder given (never the parent of a tag folder given directly: reads stay in the given folder).
    """
    in_root = path.resolve() != root.resolve()
    if config is not None:
        cfg, src = read_json(Path(config)), Path(config)
    elif (path / "config.json").is_file() or (path / "config.json").is_symlink():
        src = path / "config.json"
        cfg = read_json(confined_path(path, "config.json", src))
    elif meta["format"] == FOREIGN and in_root and (root / "config.json").is_file():  # HF Trainer's checkpoint-N/
        src = root / "config.json"
        cfg = read_json(confined_path(root, "config.json", src))
    elif meta["has_model_config"]:
        raise CheckpointError(f"{path / 'config.json'}: file is missing although metadata.json says the model "
                              "had an HF config; restore it or pass --config PATH")
    elif weights_only:
        return None
    else:
        raise CheckpointError(f"{path}: has no config.json (the model had no HF config), so the output "
                              "would not load with from_pretrained; pass --config PATH/config.json, or "
                              "--weights-only to write the safetensors files alone")
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type", ""), str):
        raise CheckpointError(f"{src}: not an HF model config (expected a JSON object)")
    return cfg


def _open_checked(ckpt_dir: str | Path, tag: str | None, verify: bool) -> tuple[Path, dict, ShardReader]:
    """The tag folder, its validated metadata and a reader whose every shard file was checked."""
    path = resolve_tag(ckpt_dir, tag)
    if path is None:
        tags = sorted(p.name for p in Path(ckpt_dir).iterdir() if p.is_dir() and (p / "metadata.json").is_file())
        hint = f"pass --tag (one of {', '.join(tags[:5])})" if tags else \
            "pass the folder that save_checkpoint wrote (it holds 'latest' and the tag folders)"
        raise CheckpointError(f"{ckpt_dir}: no 'latest' file here; {hint}")
    meta, reader = open_checkpoint(path, verify)
    for f in meta["files"]:
        reader.check(f)
    return path, meta, reader


def _full_tensors(meta: dict, reader: ShardReader, specs: list[Spec]):
    """``(name, full tensor)`` one at a time: fp32 masters for trained parameters, else the saved
    dtype (frozen parameters, buffers)."""
    tensors, extras = meta["tensors"], saved_extras(meta)
    tidx, xidx = saved_index(tensors), saved_index(extras)
    master = dtype_from_name(meta.get("master_dtype", "float32"))  # bf16/fp16 masters: read as fp32
    for name, _, shape in specs:
        trained = name in tidx
        src, keys = (tensors, tidx[name]) if trained else (extras, xidx[name])
        if src[keys[0]].get("tp"):  # TP pieces: assembled into the full (unpadded) tensor, piece by piece
            buf = torch.empty(shape, dtype=torch.float32 if trained else dtype_from_name(src[keys[0]]["dtype"]))
            t = rebuild(name, buf, None, keys, src,
                        (lambda k: read_saved(reader, tensors, "master", k, torch.float32, master)) if trained
                        else (lambda k: read_whole(reader, extras, k)))
        elif trained and len(tensors[name]["segments"]) == 1:  # one file: read it straight, no 2nd buffer
            t = reader.read_full(f"master/{name}", tensors[name]["segments"][0]["file"], torch.float32,
                                 [tensors[name]["numel"]], master).view(shape)
        elif trained:
            t = read_saved(reader, tensors, "master", name, torch.float32, master)
        else:
            t = read_whole(reader, extras, name)
        reader.release()
        yield name, t


def _saved_specs(meta: dict) -> list[Spec]:
    extras = saved_extras(meta)
    tidx, xidx = saved_index(meta["tensors"]), saved_index(extras)
    out = []
    for name in meta["order"]:
        info = meta["tensors"][tidx[name][0]] if name in tidx else extras[xidx[name][0]]
        out.append((name, dtype_from_name(info["dtype"]), tuple(logical_shape(info))))
    return out


def iter_consolidated(ckpt_dir: str | Path, tag: str | None = None, verify: bool = True):
    """The checkpoint's specs ``(name, saved dtype, full shape)`` in save order, then a generator
    of ``(name, full tensor)`` (fp32 masters for trained parameters, the saved dtype otherwise),
    one tensor at a time. Single process, no torch.distributed; every shard file is verified first.
    """
    path, meta, reader = _open_checked(ckpt_dir, tag, verify)
    specs = _saved_specs(meta)
    return path, specs, _full_tensors(meta, reader, specs)


def consolidate(ckpt_dir: str | Path, out_dir: str | Path, tag: str | None = None, dtype: str = "fp32",
                max_shard_size: str | int = "5GB", verify: bool = True, config: str | Path | None = None,
                weights_only: bool = False, overwrite: bool = False, protect: str | Path | None = None) -> list[str]:
    """Write an HF model folder from a sharded checkpoint; returns the weight file names.

    ``protect``: the folder the output may not be inside (default ``ckpt_dir``; the checkpoint
    folder's ``zero_to_fp32.py`` passes the tag folder, so ``. OUT`` works as with DeepSpeed).

    Single process, no torch.distributed. The output folder (``files.safe.OutputFolder``: not
    inside the checkpoint, no files shardwise did not write unless ``overwrite``), the metadata,
    the config and every shard file are checked before anything is written.
    """
    out_dt = dtype_from_name(dtype)
    if not out_dt.is_floating_point:  # an integer cast of trained weights keeps nothing (all zeros)
        raise CheckpointError(f"--dtype {dtype}: weights are written in a floating-point dtype; use fp32, bf16 "
                              "or fp16 (for int8/int4 weights run `shardwise quantize` on the output)")
    ckpt_dir = checkpoints_folder(ckpt_dir, tag)  # a run folder: its checkpoints/
    guard = OutputFolder(out_dir, "OUT", inputs=[protect or ckpt_dir, *([config] if config else [])],
                         overwrite=overwrite, ours=hf_output_name)
    path, meta, reader = _open_checked(ckpt_dir, tag, verify)
    side_dir, side_names = find_side_files(ckpt_dir, path)  # a user's own files in OUT are left alone:
    side_names = [n for n in side_names if n in guard.recorded or not (Path(out_dir) / n).exists()]
    cfg = _model_config_for(Path(ckpt_dir), path, meta, config, weights_only)
    saved = _saved_specs(meta)
    specs: list[Spec] = [(n, out_dt if dt.is_floating_point else dt, shape) for n, dt, shape in saved]
    out = Path(out_dir)
    w = ShardedHFWriter(out, specs, parse_bytes(max_shard_size), guard)
    from tqdm.auto import tqdm  # a 7B checkpoint takes minutes: a bar on a terminal (none in logs, disable=None)

    bar = tqdm(total=len(specs), desc="consolidate", unit="tensor", file=sys.stderr, disable=None, leave=False)
    for (name, dt, _), (_, t) in zip(specs, _full_tensors(meta, reader, saved), strict=True):
        w.write(name, t.to(dt))
        del t
        bar.update()
    bar.close()
    names = w.close()
    side = copy_side_files(side_dir, side_names, out) if side_dir is not None else []
    w.finish(_write_config(cfg, out, out_dt), side)
    return names


def _group_comm(g, dp: Comm) -> Comm:
    """The comm a group's shards are gathered over: the data-parallel one, or an expert group's own
    (uncounted; a group of one rank is its solo comm, whose process group is None, not the world)."""
    if g.own_groups is None:
        return dp
    return g.comm if g.comm.size == 1 else Comm(g.comm.group, CommStats())


def save_16bit_model(engine: CheckpointTarget, save_dir: str | Path, dtype: torch.dtype | None = None,
                     max_shard_size: str | int = "5GB") -> None:
    """HF weights from a live engine (collective): masters are gathered group by group, rank 0 writes.

    Built from the fp32 masters (own ranges + all-gather over the data-parallel group), so it does
    not depend on where the compute-dtype parameters live (stage 3 keeps only shards). Under TP each
    sharded parameter's local tensors are then all-gathered over the TP group into the full HF
    tensor (padding dropped). ``dtype`` defaults to the compute dtype.
    """
    refuse_frozen_experts(engine.module)
    comm = world_comm()
    dp = engine.comm if engine.comm.size == 1 else Comm(engine.comm.group, CommStats())
    tp = engine.tp if engine.tp.size == 1 else Comm(engine.tp.group, CommStats())
    dtype = dtype or (engine.groups[0].dtype if engine.groups else torch.float32)
    rank0 = comm.rank == 0
    extras = {}  # unsharded frozen parameters (cast; TP pieces gathered) and persistent buffers
    for n, t in module_extras(engine).items():
        v = gather_full(t.detach(), spec_of(t), tp)
        extras[n] = v.to(dtype) if isinstance(t, torch.nn.Parameter) else v
    # every TP rank walks the parameters in the model's order (TP ranks may bucket them differently);
    # stage-3 frozen groups are gathered from their stores' shards like trained ones from masters
    where = {id(p): (g, name, p, off, n) for g in engine.groups + frozen_groups(engine)
             for name, p, off, n in zip(g.names, g.params, g.offsets, g.numels, strict=True)}
    todo = [where[id(p)] for _, p in engine.module.named_parameters() if id(p) in where]
    specs = [(name, dtype, tuple(logical_shape_of(saved_shape(p), spec_of(p)))) for _, name, p, _, _ in todo]
    specs += [(n, t.dtype, tuple(t.shape)) for n, t in extras.items()]
    err, w = None, None
    try:
        if rank0:
            w = ShardedHFWriter(Path(save_dir), specs, parse_bytes(max_shard_size))
    except Exception as e:  # noqa: BLE001 - re-raised on every rank by agree()
        err = e
    agree(comm, err, "save_16bit_model")
    cached, full = None, None
    for g, name, p, off, n in todo:  # every rank joins every gather, even after rank 0 failed to write
        if g is not cached:  # one group's flat masters (a frozen group: its shards) at a time
            own = g.master if g.trainable else g.param_shard
            if own is None:
                raise NotImplementedError(f"save_16bit_model: frozen parameter {g.names[0]} is file-backed; "
                                          "its files are already the model's weights")
            full = torch.zeros(g.padded_numel, dtype=own.dtype, device=g.device)  # not the CPU master's: NCCL
            full.narrow(0, g.own_start, g.own_numel).copy_(own)
            if engine.policy.shard_optimizer:
                _group_comm(g, dp).all_gather(full)
            cached = g
        t = gather_experts(gather_full(full.narrow(0, off, n).view(full_shape(p)), spec_of(p), tp), p)
        if w is not None and err is None:
            try:
                w.write(name, t.to(dtype))
            except Exception as e:  # noqa: BLE001
                err = e
    try:
        if w is not None and err is None:
            for n, t in extras.items():
                w.write(n, t)
            w.close()
            w.finish(_write_config(model_config(engine.module), Path(save_dir), dtype))
    except Exception as e:  # noqa: BLE001
        err = e
    agree(comm, err, "save_16bit_model")
