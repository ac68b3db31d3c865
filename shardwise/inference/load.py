"""``init_inference`` underneath the public one: which path a model takes (resident, streamed,
quantized, tensor-parallel) and the world it runs in. The streaming itself is ``stream``'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm import Comm, init_distributed, make_comm
from shardwise.files.model_folder import check_model_folder, loading, refuse_missing
from shardwise.inference.allocator import pin_allocator
from shardwise.inference.quant_format import is_quantized
from shardwise.inference.quantized_linear import install
from shardwise.inference.quantized_store import open_store
from shardwise.inference.stream import OFFLOADS, inference_device, meta_model, stream_layers
from shardwise.inference.tensor_parallel import init_inference as tp_init


def _comm() -> Comm:
    """World comm under torchrun (WORLD_SIZE > 1), else a world of one without a process group."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or dist.is_initialized():
        init_distributed()
        return make_comm("world")
    return make_comm("solo")


def init_inference(model_or_path: str | os.PathLike | nn.Module, tensor_parallel_size: int = 1,
                   offload: str | None = None, dtype: torch.dtype | None = None,
                   prefetch: int = 1, quantize: str | None = None, group_size: int | None = None,
                   progress: Callable[[int, int], None] | None = None) -> nn.Module:
    """The HF model, in eval mode, with ``generate()`` and forward, its layers streamed as asked.

    Every rank must call this. ``model_or_path``: a ``save_pretrained`` folder (safetensors) or
    a model (``offload="disk"`` needs a folder). ``prefetch``: layers read ahead of the one
    running (0: none). ``quantize="int8"|"int4"``: decoder-layer Linear weights are kept
    group-wise quantized (``group_size`` elements per scale) and dequantized per layer when it is
    gathered; from disk this needs a folder written by ``shardwise quantize`` (see
    ``shardwise.inference.quant_format``), which is also picked up when ``quantize`` is None. ``progress(i, n)``
    is called as the n units are set up. What streams the layers is
    ``shardwise.inference.stream_state_of(model)`` (its ``fetcher.peak_gathered_bytes``), None when
    the weights are simply resident (one rank, no offload); ``model.memory_report()`` gives the
    bytes a streamed model holds, the gather pool included.
    """
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {OFFLOADS}, got {offload!r}")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    path = None if isinstance(model_or_path, nn.Module) else os.fspath(model_or_path)
    if offload is None and path is not None and is_quantized(path):
        raise ValueError(f"{path} holds quantized weights (shardwise quantize): load it with offload='disk' or 'cpu'")
    if tensor_parallel_size > 1:
        return _tensor_parallel(model_or_path, tensor_parallel_size, offload, dtype, prefetch, quantize, group_size)
    comm = _comm()
    if quantize is not None and (offload is None or path is None):
        raise ValueError(f"quantize={quantize!r} streams quantized layers: give a folder and offload='disk' or 'cpu'")
    if comm.size == 1 and offload is None:  # resident weights: nothing to stream
        if path is None:
            model = model_or_path.to(dtype) if dtype is not None else model_or_path
        else:
            from transformers import AutoModelForCausalLM

            check_model_folder(path)
            with loading(path):
                model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True,
                                                                   **({"dtype": dtype} if dtype else {}))
            refuse_missing(info, path)
        return model.to(inference_device()).eval()
    if path is None:
        if offload == "disk":
            raise ValueError("offload='disk' streams from a save_pretrained folder: pass its path")
        return stream_layers(model_or_path.to(dtype) if dtype else model_or_path, comm, offload, prefetch, None,
                       progress=progress)
    pin_allocator()  # before the load: a freed load-time tensor must not raise glibc's thresholds
    model, want = meta_model(path, dtype)
    files = open_store(path, model, offload, quantize, group_size)
    install(model, files, want, inference_device())  # int4 Linear weights stay packed where the CPU kernel runs
    return stream_layers(model, comm, offload, prefetch, files, want, progress)


def _tensor_parallel(model_or_path: Any, tp: int, offload: str | None, dtype: torch.dtype | None,
                     prefetch: int, quantize: str | None, group_size: int | None) -> nn.Module:
    """Hand over to the tensor-parallel inference (weights sliced per rank; streamed with offload)."""
    if offload is None and quantize is None:
        return tp_init(model_or_path, tensor_parallel_size=tp, dtype=dtype)
    if isinstance(model_or_path, nn.Module) or offload is None:
        raise ValueError(f"offload={offload!r} with tensor_parallel_size={tp} streams each rank's slices "
                         "from a save_pretrained folder: pass its path and offload='disk' or 'cpu'")
    return tp_init(model_or_path, tensor_parallel_size=tp, dtype=dtype, offload=offload, prefetch=prefetch,
                   quantize=quantize, group_size=group_size)
