"""Tensor-parallel inference without a training engine, reading only this rank's weight slices.

From a directory, the model is built with its parameters on the meta device (no memory), the TP
plan is applied (the parallel layers slice meta tensors for free), and then each parameter is
read from the safetensors files with ``get_slice`` for exactly the ranges this rank holds, so a
rank never holds (or reads) the full weights of a sharded layer. Buffers (rotary frequencies) are
built normally on the CPU.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
from torch import nn

from shardwise.comm import compute_device, init_distributed
from shardwise.mesh import get_mesh
from shardwise.tensor_parallel.layers import ShardSpec
from shardwise.tensor_parallel.plan import apply_tensor_parallel
from shardwise.zero.init import params_on_meta, weight_map


def _read_local(sl, spec: ShardSpec | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """This rank's part of one stored tensor, read by slices (zero where the vocabulary is padded)."""
    if spec is None:
        return sl[:].to(dtype)
    out = torch.zeros(shape, dtype=dtype)
    for a, b, d in spec.pieces():
        index = [slice(None)] * len(shape)
        index[spec.dim] = slice(a, b)
        out.narrow(spec.dim, d, b - a).copy_(sl[tuple(index)])
    return out


def read_tp_slice(files, key: str, spec: ShardSpec, shape: tuple[int, ...], start: int, end: int,
                  out: torch.Tensor) -> torch.Tensor:
    """This rank's slice of stored tensor ``key`` (local ``shape``) into the flat ``out``.

    The streamed (offload) path: each gather reads only this rank's part, a contiguous range per
    piece when the slice is along dim 0, one range per row when along the last dim of a matrix.
    """
    numel = math.prod(shape)
    if (start, end) != (0, numel):
        raise NotImplementedError(f"{key}: a tensor-parallel slice is streamed whole, not [{start}, {end})")
    view = out.view(shape)
    if sum(b - a for a, b, _ in spec.pieces()) < shape[spec.dim]:
        out.zero_()  # vocabulary padding
    for a, b, d in spec.pieces():
        if spec.dim == 0:
            inner = numel // shape[0]
            files.read(key, a * inner, b * inner, out[d * inner:(d + b - a) * inner])
        elif spec.dim == len(shape) - 1 == 1:
            for r in range(shape[0]):
                files.read(key, r * spec.full + a, r * spec.full + b, view[r, d:d + b - a])
        else:
            raise NotImplementedError(f"{key}: streaming a slice along dim {spec.dim} of {len(shape)}-D")
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
    from safetensors import safe_open
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
        from shardwise.inference import _stream
        from shardwise.quantize import open_store

        store = open_store(path, model, offload, quantize, group_size)
        return _stream(model, Comm(solo=True), offload, prefetch, store, dtype)
    files = weight_map(path)
    prefix = f"{model.base_model_prefix}."
    replaced: dict[int, nn.Parameter] = {}
    loaded = 0
    handles: dict[str, object] = {}
    with contextlib.ExitStack() as stack:
        for name, p in model.named_parameters():
            key = name if name in files else name.removeprefix(prefix) if name.removeprefix(prefix) in files \
                else None
            if key is None:
                raise KeyError(f"{name} is not in the safetensors files of {path}")
            if files[key] not in handles:
                handles[files[key]] = stack.enter_context(safe_open(files[key], "pt"))
            t = _read_local(handles[files[key]].get_slice(key), p._tp_spec, tuple(p.shape), dtype)
            loaded += t.numel() * t.element_size()
            new = nn.Parameter(t.to(compute_device()), requires_grad=False)
            new._tp_spec = p._tp_spec  # type: ignore[attr-defined]
            replaced[id(p)] = new
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
