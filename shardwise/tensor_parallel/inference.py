"""Tensor-parallel inference without a training engine, reading only this rank's weight slices.

From a directory, the model is built with its parameters on the meta device (no memory), the TP
plan is applied (the parallel layers slice meta tensors for free), and then each parameter is
read from the safetensors files (``shardwise.safetensors_io``) for exactly the ranges this rank holds, so a
rank never holds (or reads) the full weights of a sharded layer. Buffers (rotary frequencies) are
built normally on the CPU.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import nn

from shardwise.comm import compute_device, init_distributed
from shardwise.mesh import get_mesh
from shardwise.safetensors_io import SafetensorsFile
from shardwise.tensor_parallel.layers import ShardSpec
from shardwise.tensor_parallel.plan import apply_tensor_parallel
from shardwise.zero.init import params_on_meta, weight_map


def _full_shape(spec: ShardSpec | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the stored tensor a local parameter of ``shape`` is cut from."""
    if spec is None:
        return shape
    return (*shape[:spec.dim], spec.full, *shape[spec.dim + 1:])


def read_tp_slice(files, key: str, spec: ShardSpec, shape: tuple[int, ...], start: int, end: int,
                  out: torch.Tensor) -> torch.Tensor:
    """This rank's slice of stored tensor ``key`` (local ``shape``) into the flat ``out``.

    ``files`` is anything with ``read(key, start, end, out)`` (the one safetensors reader or a
    folder of them). Each piece is one contiguous element range per index of the dimensions
    before ``spec.dim`` (a single range for dim 0, one per row for the last dim of a matrix), so
    a rank reads only its part; positions of vocabulary padding are zero.
    """
    numel = math.prod(shape)
    if (start, end) != (0, numel):
        raise NotImplementedError(f"{key}: a tensor-parallel slice is streamed whole, not [{start}, {end})")
    if sum(b - a for a, b, _ in spec.pieces()) < shape[spec.dim]:
        out.zero_()  # vocabulary padding
    outer, inner = math.prod(shape[:spec.dim]), math.prod(shape[spec.dim + 1:])
    view = out.view(outer, shape[spec.dim], inner)
    for a, b, d in spec.pieces():
        for o in range(outer):
            first = (o * spec.full + a) * inner
            files.read(key, first, first + (b - a) * inner, view[o, d:d + b - a].reshape(-1))
    return out


def _read_local(f: SafetensorsFile, key: str, spec: ShardSpec | None, shape: tuple[int, ...],
                dtype: torch.dtype) -> torch.Tensor:
    """This rank's part of stored tensor ``key`` in ``dtype``, refused unless the stored shape is
    the one the model's config gives (else slices would be cut from the wrong rows)."""
    stored, full = f.info(key).shape, _full_shape(spec, shape)
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
    of what was sharded is ``model._tp_report``; bytes read from disk ``model._tp_bytes_loaded``.
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
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.fspath(model_or_path)
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
    if offload is not None:
        from shardwise.comm import Comm
        from shardwise.inference.quantize import open_store
        from shardwise.inference.stream import _stream

        store = open_store(path, model, offload, quantize, group_size)
        return _stream(model, Comm(solo=True), offload, prefetch, store, dtype)
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
    model.to(compute_device())
    model._tp_bytes_loaded = loaded  # type: ignore[attr-defined]
    return model.eval()
