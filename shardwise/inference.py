"""ZeRO-Inference: generate with models larger than memory, through the one stage-3 mechanism.

Streaming a decoder layer from CPU memory or from disk *is* stage 3 where the shard lives
elsewhere, so this module builds no second mechanism: every decoder layer becomes a frozen
:class:`~shardwise.zero.flat_group.ShardedGroup` and :class:`~shardwise.zero.stage3.ParamFetcher`
gathers it just before its forward, prefetches the next ``prefetch`` layers and releases it after.

* ``offload="cpu"``: the shard (the whole layer at world 1) sits in (pinned) CPU memory and
  ``gather()`` copies it to the compute device.
* ``offload="disk"``: nothing is resident; ``gather()`` reads the layer from the safetensors files
  each time (``reread_shard``), on a reader thread when prefetched so reading overlaps compute.
  Files are read with ``pread`` into the gathered buffer, not mmapped, so pages of layers already
  used never stay mapped into the process.
* several ranks (``offload=None`` under torchrun): each rank holds 1/N of every layer and
  all-gathers a layer when it runs (stage-3 inference); ``offload`` composes with it.

The root's own parameters (embeddings, final norm, head) are needed by every forward; in the
streamed modes they stay resident, as ``stage3_param_persistence_threshold`` keeps small ones.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm import Comm, compute_device, init_distributed
from shardwise.zero.flat_group import ShardedGroup, ShardPolicy
from shardwise.zero.gathered import guard_state_dict
from shardwise.zero.init import Init, swap_meta_parameters, tied_aliases, weight_map
from shardwise.zero.stage3 import ParamFetcher, assign_params, find_units

OFFLOADS = (None, "cpu", "disk")
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
              "U8": torch.uint8, "BOOL": torch.bool}


class SafetensorsReader:
    """Element ranges of named tensors from an HF safetensors folder, read with ``pread``.

    Unlike ``safe_open`` (mmap), nothing read stays mapped: after a layer is released its bytes
    are only in the kernel's page cache, which the process's RSS does not count.
    """

    def __init__(self, folder: str | os.PathLike):
        files = sorted(set(weight_map(folder).values()))
        self.entries: dict[str, tuple[int, torch.dtype, int]] = {}  # name -> (fd, dtype, byte offset)
        self._fds: list[int] = []
        for name in files:
            fd = os.open(name, os.O_RDONLY)
            self._fds.append(fd)
            head_len = int.from_bytes(os.pread(fd, 8, 0), "little")
            header = json.loads(os.pread(fd, head_len, 8))
            for key, info in header.items():
                if key != "__metadata__":
                    self.entries[key] = (fd, _ST_DTYPES[info["dtype"]], 8 + head_len + info["data_offsets"][0])
        self.bytes_read = 0
        self._lock = threading.Lock()
        # Benchmark knob: drop the pages after each read, as a model larger than RAM forces, so
        # every gather really goes to the disk (the page cache otherwise makes reads memcpy).
        self.cold = os.environ.get("SHARDWISE_COLD_READS") == "1"

    def find(self, names: list[str]) -> str:
        for n in names:
            if n in self.entries:
                return n
        raise KeyError(f"none of {names} is in the safetensors files")

    def read(self, name: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor ``name``: into ``out`` if given (converted
        to its dtype and device), else a new tensor of the stored dtype."""
        fd, dtype, base = self.entries[name]
        direct = out is not None and out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
        dst = out if direct else torch.empty(end - start, dtype=dtype)
        size = dst.numel() * dst.element_size()  # ctypes, not .numpy(): that pins the storage's size
        buf = memoryview((ctypes.c_char * size).from_address(dst.data_ptr())).cast("B")
        pos = base + start * dst.element_size()
        done = 0
        while done < size:
            n = os.preadv(fd, [buf[done:]], pos + done)
            if n <= 0:
                raise OSError(f"short read of {name} at byte {pos + done}")
            done += n
        if self.cold:
            os.posix_fadvise(fd, pos, size, os.POSIX_FADV_DONTNEED)
        with self._lock:
            self.bytes_read += size
        if out is not None and not direct:
            out.copy_(dst)
        return dst if out is None else out

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def _load_meta(path: str, dtype: torch.dtype | None) -> tuple[nn.Module, torch.dtype]:
    """The model built on meta (no weights read) and the dtype plain ``from_pretrained`` would use."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if dtype is None:
        stored = getattr(config, "dtype", None) or torch.float32
        dtype = getattr(torch, stored) if isinstance(stored, str) else stored
    with Init():
        model = AutoModelForCausalLM.from_pretrained(path, config=config)
    return model, dtype


def _device() -> torch.device:
    """The local GPU when there is one (also for one process without a process group), else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return compute_device()


def _comm() -> Comm:
    """World comm under torchrun (WORLD_SIZE > 1), else a world of one without a process group."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or dist.is_initialized():
        init_distributed()
        return Comm()
    return Comm(solo=True)


def init_inference(model_or_path: str | os.PathLike | nn.Module, tensor_parallel_size: int = 1,
                   offload: str | None = None, dtype: torch.dtype | None = None,
                   prefetch: int = 1) -> nn.Module:
    """The HF model, in eval mode, with ``generate()`` and forward, its layers streamed as asked.

    Every rank must call this. ``model_or_path``: a ``save_pretrained`` folder (safetensors) or
    a model (``offload="disk"`` needs a folder). ``prefetch``: layers read ahead of the one
    running (0: none). The fetcher is ``model.shardwise_fetcher`` (``peak_gathered_bytes``);
    it is None when the weights are simply resident (one rank, no offload).
    """
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {OFFLOADS}, got {offload!r}")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    if tensor_parallel_size > 1:
        return _tensor_parallel(model_or_path, tensor_parallel_size, offload, dtype)
    comm = _comm()
    path = None if isinstance(model_or_path, nn.Module) else os.fspath(model_or_path)
    if comm.size == 1 and offload is None:  # resident weights: nothing to stream
        if path is None:
            model = model_or_path.to(dtype) if dtype is not None else model_or_path
        else:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(path, **({"dtype": dtype} if dtype else {}))
        model.shardwise_fetcher = None
        return model.to(_device()).eval()
    if path is None:
        if offload == "disk":
            raise ValueError("offload='disk' streams from a save_pretrained folder: pass its path")
        return _stream(model_or_path.to(dtype) if dtype else model_or_path, comm, offload, prefetch, None)
    model, want = _load_meta(path, dtype)
    return _stream(model, comm, offload, prefetch, SafetensorsReader(path), want)


def _stream(model: nn.Module, comm: Comm, offload: str | None, prefetch: int,
            files: SafetensorsReader | None, dtype: torch.dtype | None = None) -> nn.Module:
    """Cut ``model`` into frozen stage-3 groups per unit and install the fetcher."""
    device = _device()
    model.eval().requires_grad_(False)
    if files is not None:  # meta parameters: placeholders now, values read unit by unit below
        swap_meta_parameters(model, device)
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = torch.full((1,), float("nan"), dtype=dtype, device=device).expand(p.shape)
    for m in model.modules():  # parameters move layer by layer, when their groups are built
        for name, b in list(m.named_buffers(recurse=False)):
            setattr(m, name, b.to(device))
    names = {id(p): n for n, p in model.named_parameters()}
    reader = None
    if files is not None:
        aliases = tied_aliases(model)
        keys = {pid: files.find(ns) for pid, ns in aliases.items()}

        def reader(p: nn.Parameter, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
            return files.read(keys[id(p)], start, end, out)

        reader.fills_out = True  # pread straight into the gathered buffer

    units = find_units(model)
    owned = assign_params(model, units)
    stage3, resident = ShardPolicy.for_stage(3), ShardPolicy.for_stage(0)
    groups: list[list[ShardedGroup]] = []
    for ui in range(len(units)):
        is_root = ui == len(units) - 1
        policy = resident if is_root and offload is not None else stage3
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in owned[ui]:
            by_dtype.setdefault(p.dtype, []).append(p)
        groups.append([
            ShardedGroup(ps, [names[id(p)] for p in ps], comm if policy is stage3 else Comm(solo=True),
                         policy, trainable=False, shard_reader=reader, device=device,
                         param_offload_device=torch.device("cpu") if offload == "cpu" else None,
                         pin_memory=offload == "cpu", reread_shard=offload == "disk" and policy is stage3)
            for ps in by_dtype.values()])
    layer_numel = max((sum(g.padded_numel for g in gs) for gs in groups[:-1]), default=0)
    if device.type == "cpu" and groups[:-1]:
        _mmap_layers(layer_numel * groups[0][0].flat_param.element_size())
    # at most the running layer plus `prefetch` read-ahead ones are ever whole
    model.shardwise_fetcher = ParamFetcher(units, groups, prefetch * layer_numel,
                                           max_live_numel=(prefetch + 1) * layer_numel)
    model.shardwise_groups = groups
    model.shardwise_files = files
    guard_state_dict(model)
    if comm.size > 1:  # ranks must make the same number of forward calls, even when done early
        plain = model.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("synced_gpus", True)
            return plain(*args, **kwargs)

        model.generate = generate
    return model


def _mmap_layers(layer_bytes: int) -> None:
    """Have glibc give every whole-layer buffer its own mapping, returned to the OS at release.

    Otherwise glibc raises its mmap threshold to the size of the first freed buffer (up to 32 MiB),
    and every later layer of that size comes from the heap and stays in RSS once freed:
    24 layers of 12.6 MB streamed from disk measured +120 MB instead of +46 MB.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, max(1 << 20, min(layer_bytes // 2, 32 << 20)))


def _tensor_parallel(model_or_path: Any, tp: int, offload: str | None, dtype: torch.dtype | None) -> nn.Module:
    """Hand over to the tensor-parallel inference (weights sliced per rank) when it is there."""
    try:
        from shardwise.tensor_parallel.inference import init_inference as tp_init
    except ImportError as e:
        raise NotImplementedError("tensor_parallel_size > 1 needs shardwise.tensor_parallel") from e
    if offload is not None:
        raise NotImplementedError(f"offload={offload!r} with tensor_parallel_size={tp}: streaming "
                                  "composes with tensor parallelism only without offload for now")
    model = tp_init(model_or_path, tensor_parallel_size=tp, dtype=dtype)
    model.shardwise_fetcher = None
    return model
