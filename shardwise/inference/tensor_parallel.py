"""Tensor-parallel inference without a training engine, reading only this rank's weight slices.

From a directory, the model is built with its parameters on the meta device (no memory), the TP
plan is applied (the parallel layers slice meta tensors for free), and then each parameter is
read from the safetensors files (``shardwise.files.safetensors_io``) for exactly the ranges this rank holds, so a
rank never holds (or reads) the full weights of a sharded layer. Buffers (rotary frequencies) are
built normally on the CPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from shardwise.comm import Comm, compute_device, init_distributed
from shardwise.files.safetensors_io import SafetensorsFile
from shardwise.layout import get_mesh
from shardwise.sharded_init.context import params_on_meta, weight_map
from shardwise.tensor_parallel.layers import ShardSpec, full_shape, read_tp_slice
from shardwise.tensor_parallel.plan import apply_tensor_parallel, tp_state_of


def _read_local(f: SafetensorsFile, key: str, spec: ShardSpec | None, shape: tuple[int, ...],
                dtype: torch.dtype) -> torch.Tensor:
    """This rank's part of stored tensor ``key`` in ``dtype``, refused unless the stored shape is
    the one the model's config gives (else slices would be cut from the wrong rows)."""
    stored, full = f.info(key).shape, full_shape(spec, shape)
    if stored != full:
        raise ValueError(f"{f.path}: tensor {key!r} is stored with shape {list(stored)} but the config "
                         f"makes it {list(full)}: config and weights do not match")
    out = torch.empty(shape, dtype=dtype)
    if spec is None:
        f.read(key, 0, out.numel(), out.view(-1))
    else:
        read_tp_slice(f, key, spec, shape, 0, out.numel(), out.view(-1))
    return out


def init_inference(model_or_path: str | os.PathLike | nn.Module, tensor_parallel_size: int = 1,
                   dtype: torch.dtype | None = None, offload: str | None = None, prefetch: int = 1,
                   quantize: str | None = None, group_size: int | None = None, **config_kwargs) -> nn.Module:
    """A TP-sharded causal LM in eval mode whose ``generate()`` works; every rank must call this.

    ``model_or_path``: a model (sharded in place) or a ``save_pretrained`` directory (only this
    rank's slices are read). Sampling draws from a seed shared within the TP group. The report
    of what was sharded and the bytes read from disk are ``tp_state_of(model)``'s.
    With ``offload="disk"|"cpu"`` the decoder layers of this rank's slices are streamed as in
    ``shardwise.inference`` (one ``ShardedGroup`` per layer over this rank alone, gathered from
    the files or CPU, optionally quantized).
    """
    init_distributed()
    tp = get_mesh(tensor_parallel_size).tp
    if isinstance(model_or_path, nn.Module):
        model = model_or_path.to(dtype) if dtype is not None else model_or_path
        apply_tensor_parallel(model, tp)
        return model.eval()
    path = os.fspath(model_or_path)
    model, dtype = _tp_meta_model(path, dtype, tp, config_kwargs)
    if offload is not None:
        from shardwise.inference.quantized_store import open_store
        from shardwise.inference.stream import stream_layers

        store = open_store(path, model, offload, quantize, group_size)
        return stream_layers(model, Comm(solo=True), offload, prefetch, store, dtype)
    loaded = _load_local_slices(model, path, dtype)
    model.to(compute_device())
    tp_state_of(model).bytes_loaded = loaded
    return model.eval()


def _tp_meta_model(path: str, dtype: torch.dtype | None, tp: Comm,
                   config_kwargs: dict) -> tuple[nn.Module, torch.dtype]:
    """The model of ``path``'s config built on meta in its dtype, then TP-sliced (slicing meta is free)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, **config_kwargs)
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with params_on_meta():
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    apply_tensor_parallel(model, tp)
    return model, dtype


def _load_local_slices(model: nn.Module, path: str, dtype: torch.dtype) -> int:
    """Replace every meta parameter by this rank's slice read from ``path``; the bytes read."""
    files = weight_map(path)
    prefix = f"{model.base_model_prefix}."
    replaced: dict[int, nn.Parameter] = {}
    loaded = 0
    handles: dict[Path, SafetensorsFile] = {}
    try:
        for name, p in model.named_parameters():
            key = name if name in files else name.removeprefix(prefix) if name.removeprefix(prefix) in files \
                else None
            if key is None:
                raise KeyError(f"{name} is not in the safetensors files of {path}")
            if files[key] not in handles:
                handles[files[key]] = SafetensorsFile(files[key])
            t = _read_local(handles[files[key]], key, p._tp_spec, tuple(p.shape), dtype)
            loaded += t.numel() * t.element_size()
            new = nn.Parameter(t.to(compute_device()), requires_grad=False)
            new._tp_spec = p._tp_spec  # type: ignore[attr-defined]
            replaced[id(p)] = new
    finally:
        for f in handles.values():
            f.close()
    for mod in model.modules():  # swap in place; a tied weight is one object in two modules
        for pname, p in list(mod._parameters.items()):
            if p is not None and id(p) in replaced:
                mod._parameters[pname] = replaced[id(p)]
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"parameters not loaded: {left[:5]}")
    return loaded
