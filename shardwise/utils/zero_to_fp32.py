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
    out = Path(output_dir)
    if safe_serialization:  # streamed, one tensor at a time (shared tensors are written once)
        if exclude_frozen_parameters:
            raise ValueError("convert_zero_checkpoint_to_fp32_state_dict: exclude_frozen_parameters=True is "
                             "supported with safe_serialization=False only")
        return consolidate(checkpoint_dir, out, tag=tag, dtype="fp32",
                           max_shard_size=max_shard_size or "1000000GB", weights_only=True)
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    out.mkdir(parents=True, exist_ok=True)
    shards = _split(state, parse_bytes(max_shard_size) if max_shard_size is not None else None)
    if len(shards) == 1:
        torch.save(shards[0], out / "pytorch_model.bin")
        return ["pytorch_model.bin"]
    names = [f"pytorch_model-{i + 1:05d}-of-{len(shards):05d}.bin" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        torch.save(shard, out / name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values())
    (out / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


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
