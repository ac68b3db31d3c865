"""DeepSpeed's ``zero_to_fp32`` for shardwise checkpoints: the full fp32 weights, offline.

One process on a CPU, no torch.distributed: the sharded checkpoint written by
``engine.save_checkpoint`` (any world size, stage or TP degree) is read by the same streaming
reader as ``shardwise consolidate`` (:func:`shardwise.checkpoint.hf.iter_consolidated`) and
returned as a plain state dict of fp32 tensors (integer buffers keep their dtype).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shardwise.checkpoint.hf import consolidate, iter_consolidated

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "convert_zero_checkpoint_to_fp32_state_dict"]


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | Path, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of the whole model in fp32 from ``checkpoint_dir`` (``tag``: the folder
    inside it; default: the one named in its ``latest`` file). Holds the whole model in memory,
    as DeepSpeed's does; ``shardwise consolidate`` streams to disk instead."""
    _, specs, stream = iter_consolidated(checkpoint_dir, tag)
    trained = _trained_names(checkpoint_dir, tag) if exclude_frozen_parameters else None
    out: dict[str, torch.Tensor] = {}
    for (name, dt, _), (_, t) in zip(specs, stream, strict=True):
        if trained is not None and name not in trained:
            continue
        out[name] = t.float() if dt.is_floating_point else t.clone()
    return out


def _trained_names(checkpoint_dir: str | Path, tag: str | None) -> set[str]:
    from shardwise.checkpoint.load import read_metadata, resolve_tag
    from shardwise.checkpoint.tp import logical_name

    meta = read_metadata(resolve_tag(checkpoint_dir, tag))
    return {logical_name(k, info) for k, info in meta["tensors"].items()}


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | Path,
                                         tag: str | None = None) -> nn.Module:
    """Load the checkpoint's fp32 weights into ``model`` (moved to the CPU, as DeepSpeed does);
    returns it. Names the checkpoint lacks or has in excess are reported, not ignored."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = {n for n in missing if n in params and any(params[m] is params[n] for m in state if m in params)}
    missing = [n for n in missing if n not in tied]
    if missing or unexpected:
        raise KeyError(f"checkpoint {checkpoint_dir} does not fit the model: missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]}")
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | Path, output_dir: str | Path,
                                               tag: str | None = None, max_shard_size: str | int = "5GB",
                                               safe_serialization: bool = True) -> list[str]:
    """Write the fp32 weights as HF safetensors files in ``output_dir`` (streamed, one tensor at a
    time); returns the file names. Only ``safe_serialization=True`` is written."""
    if not safe_serialization:
        raise ValueError("convert_zero_checkpoint_to_fp32_state_dict(safe_serialization=False): shardwise "
                         "writes safetensors only; load them with safetensors.torch.load_file")
    return consolidate(checkpoint_dir, output_dir, tag=tag, dtype="fp32", max_shard_size=max_shard_size)
