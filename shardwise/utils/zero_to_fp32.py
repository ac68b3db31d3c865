"""DeepSpeed's ``zero_to_fp32`` for shardwise checkpoints: the full fp32 weights, offline.

One process on a CPU, no torch.distributed: the sharded checkpoint written by
``engine.save_checkpoint`` (any world size, stage or TP degree) is read by the same streaming
reader as ``shardwise consolidate`` (:func:`shardwise.checkpoint.hf.iter_consolidated`) and
returned as a plain state dict of fp32 tensors (integer buffers keep their dtype).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from shardwise.checkpoint.hf import consolidate, iter_consolidated
from shardwise.estimate.memory import parse_bytes

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "convert_zero_checkpoint_to_fp32_state_dict"]


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | Path, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of the whole model in fp32 from ``checkpoint_dir`` (``tag``: the folder
    inside it; default: the one named in its ``latest`` file). Holds the whole model in memory,
    as DeepSpeed's does; ``shardwise consolidate`` streams to disk instead."""
    from shardwise.checkpoint.load import read_metadata, resolve_tag

    meta = read_metadata(resolve_tag(checkpoint_dir, tag))
    _, specs, stream = iter_consolidated(checkpoint_dir, tag)
    frozen = _frozen_names(meta) if exclude_frozen_parameters else set()
    out: dict[str, torch.Tensor] = {}
    for (name, dt, _), (_, t) in zip(specs, stream, strict=True):
        if name in frozen:
            continue
        out[name] = t.float() if dt.is_floating_point else t.clone()
    for alias, name in meta.get("tied", {}).items():  # shared parameters: every name, one tensor
        if name in out:
            out[alias] = out[name]
    return out


def _frozen_names(meta: dict) -> set[str]:
    """Frozen parameters in the checkpoint: its ``frozen`` section (format 3). Format 2 kept them
    in ``module`` with the buffers, indistinguishable: every untrained tensor is left out then."""
    from shardwise.checkpoint.tp import logical_name

    if meta["version"] >= 3:
        return {logical_name(k, info) for k, info in meta["frozen"].items()}
    return set(meta["order"]) - {logical_name(k, info) for k, info in meta["tensors"].items()}


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | Path,
                                         tag: str | None = None) -> nn.Module:
    """Load the checkpoint's fp32 weights into ``model`` (moved to the CPU, as DeepSpeed does);
    returns it. Names the checkpoint lacks or has in excess are reported, not ignored, except
    frozen parameters it was saved without (``exclude_frozen_parameters=True``): those keep the
    model's values."""
    from shardwise.checkpoint.load import read_metadata, resolve_tag

    excluded = set(read_metadata(resolve_tag(checkpoint_dir, tag))["excluded_frozen"])
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [n for n in missing if n not in excluded]
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = {n for n in missing if n in params and any(params[m] is params[n] for m in state if m in params)}
    missing = [n for n in missing if n not in tied]
    if missing or unexpected:
        raise KeyError(f"checkpoint {checkpoint_dir} does not fit the model: missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]}")
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | Path, output_dir: str | Path,
                                               max_shard_size: str | int | None = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> list[str]:
    """DeepSpeed's signature and output: the fp32 state dict in ``output_dir`` as
    ``pytorch_model.bin`` (``torch.load`` + ``load_state_dict``; shared parameters stay one tensor),
    or ``model.safetensors`` with ``safe_serialization=True``; split into HF-indexed
    ``-0000k-of-0000n`` files above ``max_shard_size``. Returns the weight file names."""
    from shardwise.checkpoint.load import resolve_tag

    out = Path(output_dir)
    if safe_serialization and not exclude_frozen_parameters:  # streamed, one tensor at a time
        return consolidate(checkpoint_dir, out, tag=tag, dtype="fp32", max_shard_size=max_shard_size or "1000000GB",
                           weights_only=True, protect=resolve_tag(checkpoint_dir, tag))
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    out.mkdir(parents=True, exist_ok=True)
    shards = _split(state, parse_bytes(max_shard_size) if max_shard_size is not None else None)
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    if len(shards) == 1:
        names = [f"{stem}.{ext}"]
    else:
        names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        _save(shard, out / name, safe_serialization)
        weight_map.update(dict.fromkeys(shard, name))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
        (out / f"{stem}.{ext}.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


def _save(shard: dict[str, torch.Tensor], path: Path, safe: bool) -> None:
    """One weight file; safetensors keeps a shared tensor once (its first name, as HF saves tied weights)."""
    if not safe:
        torch.save(shard, path)
        return
    from safetensors.torch import save_file

    seen: set[int] = set()
    unique = {}
    for name, t in shard.items():
        if id(t) not in seen:
            seen.add(id(t))
            unique[name] = t.contiguous()
    save_file(unique, str(path), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> int:
    """The ``zero_to_fp32.py`` command a checkpoint folder holds, with DeepSpeed's flags; a user
    error is one line on stderr and exit status 2."""
    import argparse
    import sys

    from shardwise.errors import OneLineError

    p = argparse.ArgumentParser(prog="zero_to_fp32.py", description="Full fp32 weights from a shardwise "
                                "checkpoint folder, as DeepSpeed's zero_to_fp32.py")
    p.add_argument("checkpoint_dir", help="the checkpoint folder (the one holding `latest`), e.g. checkpoint-12")
    p.add_argument("output_dir", help="folder for the fp32 weight files")
    p.add_argument("--max_shard_size", default="5GB", help="split the weights into files of at most this size")
    p.add_argument("--safe_serialization", action="store_true", help="write safetensors instead of torch.save")
    p.add_argument("-t", "--tag", default=None, help="the tag folder to read (default: the one `latest` names)")
    p.add_argument("--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out")
    p.add_argument("-d", "--debug", action="store_true", help="accepted, as DeepSpeed's script does")
    args = p.parse_args(argv)
    try:
        names = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir, args.output_dir, max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization, tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters)
    except (OneLineError, OSError, ValueError, KeyError) as exc:
        print(f"zero_to_fp32.py: error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
              file=sys.stderr)
        return 2
    print(f"zero_to_fp32.py: wrote {', '.join(names)} to {args.output_dir}")
    return 0


def _split(state: dict[str, torch.Tensor], limit: int | None) -> list[dict[str, torch.Tensor]]:
    """Greedy shards of at most ``limit`` bytes (a larger tensor alone); aliases of a tensor go
    with it, so each file keeps a shared parameter as one tensor."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, home = 0, {}
    for name, t in state.items():
        if id(t) in home:
            home[id(t)][name] = t
            continue
        n = t.numel() * t.element_size()
        if limit is not None and shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        home[id(t)] = shards[-1]
        size += n
    return shards
