"""ZeRO-Inference: generate with models larger than memory, through the one stage-3 mechanism.

Streaming a decoder layer from CPU memory or from disk *is* stage 3 where the shard lives
elsewhere, so this module builds no second mechanism: the one builder
(``zero/builder.build_frozen``) makes every decoder layer a frozen
:class:`~shardwise.zero.flat_group.ShardedGroup` whose shard store (``zero/store.py``) is chosen
by ``offload``, and :class:`~shardwise.zero.stage3.ParamFetcher` gathers it just before its
forward, prefetches the next ``prefetch`` layers and releases it after.

* ``offload="cpu"``: the shard (the whole layer at world 1) sits in (pinned) CPU memory and
  ``gather()`` copies it to the compute device.
* ``offload="disk"``: nothing is resident; ``gather()`` reads the layer from the safetensors files
  each time (a ``FileStore``), on a reader thread when prefetched so reading overlaps compute.
  Files are read with ``pread`` into the gathered buffer, not mmapped, so pages of layers already
  used never stay mapped into the process.
* several ranks (``offload=None`` under torchrun): each rank holds 1/N of every layer and
  all-gathers a layer when it runs (stage-3 inference); ``offload`` composes with it.

The root's own parameters (embeddings, final norm, head) are needed by every forward; in the
streamed modes they stay resident, as ``stage3_param_persistence_threshold`` keeps small ones.
Decoder layers are gathered into a fixed :class:`~shardwise.zero.gather_pool.GatherPool` of
``prefetch + 1`` layer buffers made once, so the memory held does not depend on the allocator.
``quantize=`` streams group-wise int8/int4 weights from a :class:`~shardwise.quantize.QuantizedStore`
(another shard store), dequantized into the gathered buffer.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm import Comm, compute_device, init_distributed
from shardwise.zero.builder import build_frozen
from shardwise.zero.gathered import guard_state_dict
from shardwise.zero.init import Init, swap_meta_parameters, tied_aliases
from shardwise.zero.stage3 import ParamFetcher

OFFLOADS = (None, "cpu", "disk")
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
              "U8": torch.uint8, "BOOL": torch.bool}


def _confined_files(folder: str) -> list[str]:
    """The safetensors files of ``folder``, each proven to lie inside it.

    An index entry that is absolute, climbs with ``..`` or is a symlink out of the folder would
    make a downloaded model read any file on the machine: refused, naming the index and entry.
    """
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.exists(index):
        single = os.path.join(folder, "model.safetensors")
        if not os.path.exists(single):
            raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json "
                                    "(shardwise reads weights from safetensors only)")
        entries = {"*": "model.safetensors"}
    else:
        try:
            with open(index) as f:
                entries = json.load(f)["weight_map"]
            entries = dict(entries)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    for name, rel in entries.items():
        if not isinstance(rel, str) or os.path.isabs(rel) or ".." in rel.replace("\\", "/").split("/"):
            raise ValueError(f"{index}: entry {name!r} points at {rel!r}, outside the model folder; "
                             "only file names relative to the folder are allowed")
    root = os.path.realpath(folder)
    files = sorted({os.path.join(folder, rel) for rel in entries.values()})
    for f in files:
        if os.path.commonpath([root, os.path.realpath(f)]) != root:
            raise ValueError(f"{f}: resolves outside the model folder {folder} (a symlink?); refused")
    return files


def read_into(fd: int, pos: int, dst: torch.Tensor, what: str) -> None:
    """``pread`` ``dst.nbytes`` bytes at ``pos`` straight into the CPU tensor ``dst`` (no temporary)."""
    size = dst.numel() * dst.element_size()  # ctypes, not .numpy(): that pins the storage's size
    buf = memoryview((ctypes.c_char * size).from_address(dst.data_ptr())).cast("B")
    done = 0
    while done < size:
        n = os.preadv(fd, [buf[done:]], pos + done)
        if n <= 0:
            raise OSError(f"short read of {what} at byte {pos + done}")
        done += n


class SafetensorsReader:
    """Element ranges of named tensors from an HF safetensors folder, read with ``pread``.

    Unlike ``safe_open`` (mmap), nothing read stays mapped: after a layer is released its bytes
    are only in the kernel's page cache, which the process's RSS does not count. Every header is
    checked when opened (known dtype, byte span = shape x dtype, inside the file), and
    :meth:`check_shape` holds each tensor to the model's shape, so weights that do not match the
    config are refused by file and tensor instead of streaming garbage.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)
        self.entries: dict[str, tuple[int, torch.dtype, int]] = {}  # name -> (fd, dtype, byte offset)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.file_of: dict[str, str] = {}
        self._fds: list[int] = []
        for name in _confined_files(self.folder):
            fd = os.open(name, os.O_RDONLY)
            self._fds.append(fd)
            self._parse_header(fd, name)
        self.bytes_read = 0
        self._lock = threading.Lock()
        # Benchmark knob: drop the pages after each read, as a model larger than RAM forces, so
        # every gather really goes to the disk (the page cache otherwise makes reads memcpy).
        self.cold = os.environ.get("SHARDWISE_COLD_READS") == "1"

    def _parse_header(self, fd: int, path: str) -> None:
        size = os.fstat(fd).st_size
        head_len = int.from_bytes(os.pread(fd, 8, 0), "little") if size >= 8 else -1
        if not 0 < head_len <= min(size - 8, 100 << 20):
            raise ValueError(f"{path}: not a safetensors file (header length {head_len}, file {size} bytes)")
        try:
            header = json.loads(os.pread(fd, head_len, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: unreadable safetensors header ({e})") from None
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dt = info.get("dtype") if isinstance(info, dict) else None
            if dt not in _ST_DTYPES:
                raise ValueError(f"{path}: tensor {key!r} has dtype {dt!r}, which shardwise cannot stream "
                                 f"(supported: {', '.join(_ST_DTYPES)}); convert the checkpoint first")
            dtype, shape, (a, b) = _ST_DTYPES[dt], tuple(info["shape"]), info["data_offsets"]
            want = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if b - a != want or a < 0 or 8 + head_len + b > size:
                raise ValueError(f"{path}: tensor {key!r} is {dt} {list(shape)} = {want} bytes but its header "
                                 f"gives bytes [{a}, {b}) of a {size}-byte file: header and data disagree")
            self.entries[key] = (fd, dtype, 8 + head_len + a)
            self.shapes[key], self.file_of[key] = shape, path

    def find(self, names: list[str]) -> str:
        for n in names:
            if n in self.entries:
                return n
        raise KeyError(f"none of {names} is in the safetensors files of {self.folder}")

    def check_shape(self, key: str, shape: tuple[int, ...], floating: bool = True) -> None:
        """Refuse a stored tensor whose shape is not the one the model (its config) expects, or
        integer data for a floating-point parameter (a header whose dtype was changed)."""
        if floating and not self.entries[key][1].is_floating_point:
            raise ValueError(f"{self.file_of[key]}: tensor {key!r} is stored as {self.entries[key][1]}, not a "
                             "floating-point dtype; the header does not describe these weights")
        if tuple(self.shapes[key]) != tuple(shape):
            raise ValueError(f"{self.file_of[key]}: tensor {key!r} is stored with shape {list(self.shapes[key])} "
                             f"but {self.folder}/config.json makes it {list(shape)}: config and weights "
                             "do not match (fix the config or use the weights it was saved with)")

    def read(self, name: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor ``name``: into ``out`` if given (converted
        to its dtype and device), else a new tensor of the stored dtype."""
        fd, dtype, base = self.entries[name]
        direct = out is not None and out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
        dst = out if direct else torch.empty(end - start, dtype=dtype)
        self.read_bytes(fd, base + start * dst.element_size(), dst, name)
        if out is not None and not direct:
            out.copy_(dst)
        return dst if out is None else out

    def read_bytes(self, fd: int, pos: int, dst: torch.Tensor, what: str) -> None:
        """One counted (and, cold, evicted) read of ``dst``'s bytes at ``pos``."""
        read_into(fd, pos, dst, what)
        size = dst.numel() * dst.element_size()
        if self.cold:
            os.posix_fadvise(fd, pos, size, os.POSIX_FADV_DONTNEED)
        with self._lock:
            self.bytes_read += size

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
                   prefetch: int = 1, quantize: str | None = None, group_size: int | None = None,
                   progress: Callable[[int, int], None] | None = None) -> nn.Module:
    """The HF model, in eval mode, with ``generate()`` and forward, its layers streamed as asked.

    Every rank must call this. ``model_or_path``: a ``save_pretrained`` folder (safetensors) or
    a model (``offload="disk"`` needs a folder). ``prefetch``: layers read ahead of the one
    running (0: none). ``quantize="int8"|"int4"``: decoder-layer Linear weights are kept
    group-wise quantized (``group_size`` elements per scale) and dequantized per layer when it is
    gathered; from disk this needs a folder written by ``shardwise quantize`` (see
    ``shardwise.quantize``), which is also picked up when ``quantize`` is None. ``progress(i, n)``
    is called as the n units are set up. The fetcher is ``model.shardwise_fetcher``
    (``peak_gathered_bytes``), None when the weights are simply resident (one rank, no offload);
    ``model.memory_report()`` gives the bytes held, the gather pool included.
    """
    from shardwise.quantize import is_quantized, open_store

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

            model = AutoModelForCausalLM.from_pretrained(path, **({"dtype": dtype} if dtype else {}))
        model.shardwise_fetcher = None
        return model.to(_device()).eval()
    if path is None:
        if offload == "disk":
            raise ValueError("offload='disk' streams from a save_pretrained folder: pass its path")
        return _stream(model_or_path.to(dtype) if dtype else model_or_path, comm, offload, prefetch, None,
                       progress=progress)
    model, want = _load_meta(path, dtype)
    files = open_store(path, model, offload, quantize, group_size)
    from shardwise.quantized_linear import install

    install(model, files, want, _device())  # int4 Linear weights stay packed where the CPU kernel runs
    return _stream(model, comm, offload, prefetch, files, want, progress)


def param_reader(model: nn.Module, files: SafetensorsReader) -> Callable[..., torch.Tensor]:
    """``reader(p, start, end, out)`` for ``ShardedGroup``: elements of ``p`` from ``files``.

    Each parameter is bound to its stored tensor once, and the stored shape is checked against
    the model's (for a tensor-parallel slice, against the full tensor it is cut from).
    """
    keys: dict[int, str] = {}
    by_name = dict(model.named_parameters(remove_duplicate=False))
    for pid, names in tied_aliases(model).items():
        p = by_name[names[0]]
        keys[pid] = files.find(names)
        spec = getattr(p, "_tp_spec", None)
        full = list(p.shape)
        if spec is not None:
            full[spec.dim] = spec.full
        files.check_shape(keys[pid], tuple(full), p.is_floating_point())

    def reader(p: nn.Parameter, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        spec = getattr(p, "_tp_spec", None)
        if spec is not None:
            from shardwise.tensor_parallel.inference import read_tp_slice

            out = out if out is not None else torch.empty(end - start, dtype=p.dtype)
            return read_tp_slice(files, keys[id(p)], spec, tuple(p.shape), start, end, out)
        return files.read(keys[id(p)], start, end, out)

    reader.fills_out = True  # pread straight into the gathered buffer
    return reader


def _stream(model: nn.Module, comm: Comm, offload: str | None, prefetch: int,
            files: SafetensorsReader | None, dtype: torch.dtype | None = None,
            progress: Callable[[int, int], None] | None = None) -> nn.Module:
    """Cut ``model`` into frozen stage-3 groups per unit and install the fetcher.

    Decoder layers are gathered into a :class:`GatherPool` of ``prefetch + 1`` buffers made
    here once; the root (kept whole when streaming, else gathered for the whole forward) is not.
    """
    device = _device()
    model.eval().requires_grad_(False)
    if files is not None:  # meta parameters: placeholders now, values read unit by unit below
        specs = {id(p): getattr(p, "_tp_spec", None) for p in model.parameters()}
        for old, new in swap_meta_parameters(model, device).items():
            if specs.get(old) is not None:
                new._tp_spec = specs[old]  # a tensor-parallel slice: which part of the stored tensor
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = torch.full((1,), float("nan"), dtype=dtype, device=device).expand(p.shape)
    for m in model.modules():  # parameters move layer by layer, when their groups are built
        for name, b in list(m.named_buffers(recurse=False)):
            setattr(m, name, b.to(device))
    reader = param_reader(model, files) if files is not None else None
    # a store holding the layers itself (quantized in memory) is their persistent copy, as files are
    rereads = offload == "disk" or getattr(files, "holds_layers", False)
    mode = "file" if rereads else "cpu" if offload == "cpu" else "device"
    units, groups, pool = build_frozen(
        model, comm, mode, reader, whole_root=offload is not None, layers_held=prefetch + 1, device=device,
        progress=progress)
    layer_numel = max((sum(g.padded_numel for g in gs) for gs in groups[:-1]), default=0)
    # at most the running layer plus `prefetch` read-ahead ones are ever whole
    model.shardwise_fetcher = ParamFetcher(units, groups, prefetch * layer_numel,
                                           max_live_numel=(prefetch + 1) * layer_numel)
    model.shardwise_groups = groups
    model.shardwise_files = files
    model.shardwise_pool = pool
    model.memory_report = lambda: memory_report(model)
    guard_state_dict(model)
    if comm.size > 1:  # ranks must make the same number of forward calls, even when done early
        plain = model.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("synced_gpus", True)
            return plain(*args, **kwargs)

        model.generate = generate
    return model


def memory_report(model: nn.Module) -> dict[str, int]:
    """Bytes this rank holds for a streamed model, by kind (tensor bytes, not RSS).

    ``params``: resident parameters (root, CPU-offloaded or quantized shards); ``gather_pool``:
    the fixed buffers layers are gathered into; ``buffers``: module buffers (rotary tables).
    """
    groups = [g for gs in model.shardwise_groups for g in gs]
    store = getattr(model.shardwise_files, "resident_bytes", 0)
    pool = model.shardwise_pool
    rep = {"params": sum(g.memory()["params"] for g in groups) + store,
           "gather_pool": pool.nbytes if pool is not None else 0,
           "buffers": sum(b.numel() * b.element_size() for b in model.buffers())}
    rep["total"] = sum(rep.values())
    rep["peak_gathered_params"] = model.shardwise_fetcher.peak_gathered_bytes
    rep["gather_pool_overflow"] = pool.overflow if pool is not None else 0
    return rep


def _tensor_parallel(model_or_path: Any, tp: int, offload: str | None, dtype: torch.dtype | None,
                     prefetch: int, quantize: str | None, group_size: int | None) -> nn.Module:
    """Hand over to the tensor-parallel inference (weights sliced per rank; streamed with offload)."""
    from shardwise.tensor_parallel.inference import init_inference as tp_init

    if offload is None and quantize is None:
        model = tp_init(model_or_path, tensor_parallel_size=tp, dtype=dtype)
        model.shardwise_fetcher = None
        return model
    if isinstance(model_or_path, nn.Module) or offload is None:
        raise ValueError(f"offload={offload!r} with tensor_parallel_size={tp} streams each rank's slices "
                         "from a save_pretrained folder: pass its path and offload='disk' or 'cpu'")
    return tp_init(model_or_path, tensor_parallel_size=tp, dtype=dtype, offload=offload, prefetch=prefetch,
                   quantize=quantize, group_size=group_size)
