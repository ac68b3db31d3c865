"""HF-format weights: offline consolidation of a sharded checkpoint, and export from a live engine.

Both stream one tensor at a time into planned safetensors files, so peak memory is about the
largest tensor (plus its cast copy), never the model: DeepSpeed's zero_to_fp32 assembles the
whole state dict in RAM instead.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shardwise.checkpoint.fileio import (
    CheckpointError,
    SafetensorsWriter,
    ShardReader,
    agree,
    dtype_from_name,
    dtype_name,
    read_json,
    world_comm,
    write_json,
)
from shardwise.checkpoint.load import read_metadata, read_saved, resolve_tag
from shardwise.checkpoint.save import _model_config, full_shape, module_extras
from shardwise.checkpoint.tp import gather_full, logical_shape, logical_shape_of, rebuild, saved_index, spec_of
from shardwise.comm import Comm, CommStats

if TYPE_CHECKING:
    from shardwise.engine import Engine

Spec = tuple[str, torch.dtype, tuple[int, ...]]


def parse_size(s: str | int) -> int:
    """``"5GB"`` (10^9), ``"500MiB"`` (2^20), ``"2e9"`` or an int -> bytes."""
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?i?B)?\s*", s, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"bad size {s!r}; examples: 5GB, 500MB, 2GiB, 1000000")
    unit = (m.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = "BKMGT".index(unit[0]) if unit[0] in "KMGT" else 0
    return int(float(m.group(1)) * base**power)


def _nbytes(spec: Spec) -> int:
    n = 1
    for s in spec[2]:
        n *= s
    return n * torch.empty((), dtype=spec[1]).element_size()


class ShardedHFWriter:
    """``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + index, written in spec order."""

    def __init__(self, out_dir: Path, specs: list[Spec], max_shard_size: int):
        self.out = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in [*out_dir.glob("model*.safetensors"), out_dir / "model.safetensors.index.json"]:
            old.unlink(missing_ok=True)  # stale shards of an earlier export would shadow the new ones
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
        if self._w is None:
            self._w = SafetensorsWriter(self.out / self.names[self._i], self.shards[self._i])
        self._w.write(name, t)
        self._j += 1
        if self._j == len(self.shards[self._i]):
            self._w.close()
            self._w, self._i, self._j = None, self._i + 1, 0

    def close(self) -> list[str]:
        if len(self.names) > 1:
            wm = {s[0]: f for f, shard in zip(self.names, self.shards, strict=True) for s in shard}
            write_json(self.out / "model.safetensors.index.json",
                       {"metadata": {"total_size": self.total}, "weight_map": wm})
        return self.names


def _write_config(cfg: dict | None, out: Path, dtype: torch.dtype) -> None:
    if cfg is None:
        return
    cfg = dict(cfg)
    keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]
    for k in keys:
        cfg[k] = dtype_name(dtype)
    write_json(out / "config.json", cfg)


def consolidate(ckpt_dir: str | Path, out_dir: str | Path, tag: str | None = None, dtype: str = "fp32",
                max_shard_size: str | int = "5GB", verify: bool = True) -> list[str]:
    """Write an HF model folder from a sharded checkpoint; returns the weight file names.

    Single process, no torch.distributed. Every shard file is verified before anything is written.
    """
    path = resolve_tag(ckpt_dir, tag)
    if path is None:
        raise CheckpointError(f"{ckpt_dir}: no 'latest' file; pass --tag")
    meta = read_metadata(path)
    tensors, module = meta["tensors"], meta["module"]
    tidx, midx = saved_index(tensors), saved_index(module)
    reader = ShardReader(path, meta["files"], verify=verify)
    for f in meta["files"]:
        reader.check(f)
    out_dt = dtype_from_name(dtype)
    specs: list[Spec] = []
    for name in meta["order"]:
        info = tensors[tidx[name][0]] if name in tidx else module[midx[name][0]]
        dt = dtype_from_name(info["dtype"])
        specs.append((name, out_dt if dt.is_floating_point else dt, tuple(logical_shape(info))))
    out = Path(out_dir)
    w = ShardedHFWriter(out, specs, parse_size(max_shard_size))
    for name, dt, shape in specs:
        trained = name in tidx
        src, keys = (tensors, tidx[name]) if trained else (module, midx[name])
        if src[keys[0]].get("tp"):  # TP pieces: assembled into the full (unpadded) tensor, piece by piece
            buf = torch.empty(shape, dtype=torch.float32 if trained else dtype_from_name(src[keys[0]]["dtype"]))
            t = rebuild(name, buf, None, keys, src,
                        (lambda k: read_saved(reader, tensors, "master", k, torch.float32)) if trained
                        else (lambda k: reader.read_full(f"module/{k}", module[k]["file"])))
        elif trained and len(tensors[name]["segments"]) == 1:  # one file: read it straight, no 2nd buffer
            t = reader.read_full(f"master/{name}", tensors[name]["segments"][0]["file"]).view(shape)
        elif trained:
            t = read_saved(reader, tensors, "master", name, torch.float32)
        else:
            t = reader.read_full(f"module/{name}", module[name]["file"])
        reader.release()
        w.write(name, t.to(dt))
        del t
    names = w.close()
    cfg_path = path / "config.json"
    _write_config(read_json(cfg_path) if cfg_path.is_file() else None, out, out_dt)
    return names


def consolidate_main(argv: list[str] | None = None) -> int:
    """``shardwise consolidate``: sharded checkpoint -> HF folder loadable by ``from_pretrained``."""
    from shardwise.cli_errors import OneLineParser, one_line

    p = OneLineParser(
        prog="shardwise consolidate",
        description="Write Hugging Face weights (config.json + model*.safetensors) from a shardwise "
                    "checkpoint saved at any world size, ZeRO stage and TP degree, one tensor at a time.",
        epilog="examples:\n  shardwise consolidate ckpts/ hf_out/\n"
               "  shardwise consolidate ckpts/ hf_out/ --tag global_step1000 --dtype bf16 "
               "--max-shard-size 2GB",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt_dir", help="folder given to save_checkpoint (holding 'latest' and tag folders)")
    p.add_argument("out_dir", help="output folder for the HF model")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    p.add_argument("--dtype", default="fp32", help="fp32 (default: the exact fp32 master), bf16 or fp16")
    p.add_argument("--max-shard-size", default="5GB", help="largest weight file, e.g. 5GB, 500MB")
    p.add_argument("--no-verify", action="store_true", help="skip sha256 checks (sizes still checked)")
    a = p.parse_args(argv)
    if not Path(a.ckpt_dir).is_dir():
        p.error(f"{a.ckpt_dir!r} is not a folder; pass the folder given to save_checkpoint")
    try:
        names = consolidate(a.ckpt_dir, a.out_dir, a.tag, a.dtype, a.max_shard_size, not a.no_verify)
    except (CheckpointError, ValueError) as e:
        print(f"shardwise consolidate: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(f"wrote {len(names)} weight file(s) to {a.out_dir}")
    return 0


def save_16bit_model(engine: Engine, save_dir: str | Path, dtype: torch.dtype | None = None,
                     max_shard_size: str | int = "5GB") -> None:
    """HF weights from a live engine (collective): masters are gathered group by group, rank 0 writes.

    Built from the fp32 masters (own ranges + all-gather over the data-parallel group), so it does
    not depend on where the compute-dtype parameters live (stage 3 keeps only shards). Under TP each
    sharded parameter's local tensors are then all-gathered over the TP group into the full HF
    tensor (padding dropped). ``dtype`` defaults to the compute dtype.
    """
    comm = world_comm()
    dp = engine.comm if engine.comm.size == 1 else Comm(engine.comm.group, CommStats())
    tp = engine.tp if engine.tp.size == 1 else Comm(engine.tp.group, CommStats())
    dtype = dtype or (engine.groups[0].dtype if engine.groups else torch.float32)
    rank0 = comm.rank == 0
    extras = {}  # frozen parameters (cast; TP pieces gathered) and persistent buffers
    for n, t in module_extras(engine).items():
        v = gather_full(t.detach(), spec_of(t), tp)
        extras[n] = v.to(dtype) if isinstance(t, torch.nn.Parameter) else v
    # every TP rank walks the parameters in the model's order (TP ranks may bucket them differently)
    where = {id(p): (g, name, p, off, n) for g in engine.groups
             for name, p, off, n in zip(g.names, g.params, g.offsets, g.numels, strict=True)}
    todo = [where[id(p)] for _, p in engine.module.named_parameters() if id(p) in where]
    specs = [(name, dtype, tuple(logical_shape_of(full_shape(p), spec_of(p)))) for _, name, p, _, _ in todo]
    specs += [(n, t.dtype, tuple(t.shape)) for n, t in extras.items()]
    err: BaseException | None = None
    w = None
    try:
        if rank0:
            w = ShardedHFWriter(Path(save_dir), specs, parse_size(max_shard_size))
    except Exception as e:  # noqa: BLE001 - re-raised on every rank by agree()
        err = e
    agree(comm, err, "save_16bit_model")
    cached, full = None, None
    for g, name, p, off, n in todo:  # every rank joins every gather, even after rank 0 failed to write
        if g is not cached:  # one group's flat masters at a time
            full = torch.zeros(g.padded_numel, dtype=g.master.dtype, device=g.master.device)
            full.narrow(0, g.own_start, g.own_numel).copy_(g.master)
            if engine.stage >= 1:
                dp.all_gather(full)
            cached = g
        t = gather_full(full.narrow(0, off, n).view(full_shape(p)), spec_of(p), tp)
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
            _write_config(_model_config(engine.module), Path(save_dir), dtype)
    except Exception as e:  # noqa: BLE001
        err = e
    agree(comm, err, "save_16bit_model")
