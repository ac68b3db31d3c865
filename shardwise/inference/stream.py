"""ZeRO-Inference: generate with models larger than memory, through the one stage-3 mechanism.

Streaming a decoder layer from CPU memory or from disk *is* stage 3 where the shard lives
elsewhere, so this module builds no second mechanism: the one builder
(``zero/builder.build_frozen``) makes every decoder layer a frozen
:class:`~shardwise.zero.flat_group.ShardedGroup` whose shard store (``zero/store.py``) is chosen
by ``offload``, and :class:`~shardwise.zero.stage3.fetcher.ParamFetcher` gathers it just before its
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
``prefetch + 1`` layer buffers made once (a prefetch waits when all are taken), and glibc's
thresholds are pinned (``inference.allocator``), so the memory held does not depend on the
allocator or on how threads are scheduled: ``inference.bound`` states the bound.
``quantize=`` streams group-wise int8/int4 weights from a :class:`~shardwise.inference.quantized_store.QuantizedStore`
(another shard store), dequantized into the gathered buffer.
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.comm import Comm, compute_device
from shardwise.errors import UserError
from shardwise.files.model_folder import check_model_folder, loading
from shardwise.files.safe import confine, hub_roots, read_in
from shardwise.files.safetensors_io import SafetensorsFile, TensorInfo
from shardwise.inference.allocator import pin_allocator
from shardwise.sharded_init.context import Init, swap_meta_parameters, tied_aliases
from shardwise.tensor_parallel.layers import read_tp_slice
from shardwise.units import ByteCounts
from shardwise.zero.builder import build_frozen
from shardwise.zero.flat_group import ShardedGroup
from shardwise.zero.gather_pool import GatherPool
from shardwise.zero.stage3.fetcher import ParamFetcher
from shardwise.zero.stage3.gathered import guard_state_dict

OFFLOADS = (None, "cpu", "disk")


def _confined_files(folder: str) -> list[str]:
    """The safetensors files of ``folder``, each a regular file proven to lie inside it.

    An index entry that is absolute, climbs with ``..`` or is a symlink out of the folder would
    make a downloaded model read any file on the machine: refused, naming the index and entry
    (``files.safe.confine``; a hub snapshot may link into its own ``blobs``).
    """
    also = hub_roots(folder)
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.lexists(index):
        if not os.path.lexists(os.path.join(folder, "model.safetensors")):
            raise UserError(f"{folder}: no model.safetensors or model.safetensors.index.json "
                            "(shardwise reads weights from safetensors only)")
        return [str(confine(folder, "model.safetensors", folder, also=also))]
    try:
        entries = dict(json.loads(read_in(folder, "model.safetensors.index.json", also=also))["weight_map"])
    except (ValueError, KeyError, TypeError) as e:
        if isinstance(e, UserError):
            raise
        raise UserError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    return sorted({str(confine(folder, rel, f"{index}: entry {name!r}", also=also)) for name, rel in entries.items()})


class SafetensorsReader:
    """Element ranges of named tensors from an HF safetensors folder, read with ``pread``.

    The folder-level part of ZeRO-Inference's reading: which files (the index, confined to the
    folder) and which name is where. Each file's header is checked by
    :class:`~shardwise.files.safetensors_io.SafetensorsFile` (nothing stays mmapped, so after a layer
    is released its bytes are only in the page cache, which RSS does not count), and
    :meth:`check_shape` holds each tensor to the model's shape, so weights that do not match the
    config are refused by file and tensor instead of streaming garbage.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)
        self._bytes_base = 0
        self.files: list[SafetensorsFile] = []
        self.file_of: dict[str, SafetensorsFile] = {}
        try:
            for name in _confined_files(self.folder):
                try:
                    self.files.append(SafetensorsFile(name))
                except (ValueError, OSError) as e:  # damaged or truncated: the user's file, one line
                    raise UserError(str(e)) from None
                self.file_of.update(dict.fromkeys(self.files[-1].tensors, self.files[-1]))
        except BaseException:
            self.close()
            raise
        self.tensors: dict[str, TensorInfo] = {k: f.tensors[k] for k, f in self.file_of.items()}
        self._file_number = {id(f): i for i, f in enumerate(self.files)}

    @property
    def bytes_read(self) -> int:
        """Bytes read from the files since the count was last set (``generate`` zeroes it after the load)."""
        return sum(f.bytes_read for f in self.files) - self._bytes_base

    @bytes_read.setter
    def bytes_read(self, value: int) -> None:
        self._bytes_base = sum(f.bytes_read for f in self.files) - value

    def find(self, names: list[str]) -> str:
        for n in names:
            if n in self.tensors:
                return n
        raise UserError(f"{self.folder}: the safetensors files have no weight {names[0]!r} (nor "
                        f"{names[1:]}); refusing to leave it at random init")

    def check_shape(self, key: str, shape: tuple[int, ...], floating: bool = True) -> None:
        """Refuse a stored tensor whose shape is not the one the model (its config) expects, or
        integer data for a floating-point parameter (a header whose dtype was changed)."""
        t, path = self.tensors[key], self.file_of[key].path
        if floating and not t.dtype.is_floating_point:
            raise ValueError(f"{path}: tensor {key!r} is stored as {t.dtype}, not a "
                             "floating-point dtype; the header does not describe these weights")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{path}: tensor {key!r} is stored with shape {list(t.shape)} "
                             f"but {self.folder}/config.json makes it {list(shape)}: config and weights "
                             "do not match (fix the config or use the weights it was saved with)")

    def read(self, name: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor ``name``: into ``out`` if given (converted
        to its dtype and device), else a new tensor of the stored dtype."""
        return self.file_of[name].read(name, start, end, out)

    def position(self, name: str, start: int) -> tuple[int, int]:
        """Where element ``start`` of ``name`` lies: (file number, byte offset), to read in file order."""
        t = self.tensors[name]
        return self._file_number[id(self.file_of[name])], t.offset + start * t.dtype.itemsize

    def read_raw(self, name: str, byte_start: int, dst: torch.Tensor) -> None:
        """``dst``'s size in bytes from byte ``byte_start`` of ``name``'s data, as stored."""
        self.file_of[name].read_raw(name, byte_start, dst)

    def close(self) -> None:
        for f in self.files:
            f.close()


def meta_model(path: str, dtype: torch.dtype | None) -> tuple[nn.Module, torch.dtype]:
    """The model built on meta (no weights read) and the dtype plain ``from_pretrained`` would use."""
    from transformers import AutoConfig, AutoModelForCausalLM

    check_model_folder(path)
    with loading(path):
        config = AutoConfig.from_pretrained(path)
    if dtype is None:
        stored = getattr(config, "dtype", None) or torch.float32
        dtype = getattr(torch, stored) if isinstance(stored, str) else stored
    with Init(), loading(path):
        model = AutoModelForCausalLM.from_pretrained(path, config=config)
    return model, dtype


def inference_device() -> torch.device:
    """The local GPU when there is one (also for one process without a process group), else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return compute_device()


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
            out = out if out is not None else torch.empty(end - start, dtype=p.dtype)
            return read_tp_slice(files, keys[id(p)], spec, tuple(p.shape), start, end, out)
        return files.read(keys[id(p)], start, end, out)

    def position(p: nn.Parameter, start: int) -> tuple[int, int]:
        return files.position(keys[id(p)], 0 if getattr(p, "_tp_spec", None) is not None else start)

    reader.fills_out = True  # pread straight into the gathered buffer
    reader.position = position  # a layer's reads go in file order (zero/store.read_segments)
    return reader


def stream_layers(model: nn.Module, comm: Comm, offload: str | None, prefetch: int,
            files: SafetensorsReader | None, dtype: torch.dtype | None = None,
            progress: Callable[[int, int], None] | None = None) -> nn.Module:
    """Cut ``model`` into frozen stage-3 groups per unit and install the fetcher.

    Decoder layers are gathered into a :class:`GatherPool` of ``prefetch + 1`` buffers made
    here once; the root (kept whole when streaming, else gathered for the whole forward) is not.
    """
    pin_allocator()  # freed memory goes back at once: the bound of inference/bound.py holds
    device = inference_device()
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
    fetcher = ParamFetcher(units, groups, prefetch * layer_numel, max_live_numel=(prefetch + 1) * layer_numel)
    model.__dict__[_STREAM_SLOT] = StreamState(fetcher, groups, files, pool)
    model.memory_report = types.MethodType(memory_report, model)  # the public method (docs/inference.md)
    guard_state_dict(model)
    if comm.size > 1:  # ranks must make the same number of forward calls, even when done early
        plain = model.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("synced_gpus", True)
            return plain(*args, **kwargs)

        model.generate = generate
    return model


_STREAM_SLOT = "_shardwise_stream"  # where a streamed model keeps its StreamState (read through stream_state_of)


@dataclass
class StreamState:
    """What a streamed model carries: the fetcher that gathers its units (``peak_gathered_bytes``),
    its frozen groups per unit (the root's last), the shard store read from (None: the weights
    were given as a module) and the gather pool (None: nothing pooled)."""

    fetcher: ParamFetcher
    groups: list[list[ShardedGroup]]
    files: Any
    pool: GatherPool | None


def stream_state_of(model: nn.Module) -> StreamState | None:
    """The model's :class:`StreamState`; None when its weights are simply resident (not streamed)."""
    return model.__dict__.get(_STREAM_SLOT)


def memory_report(model: nn.Module) -> dict[str, int]:
    """Bytes this rank holds for a streamed model, by kind (tensor bytes, not RSS).

    ``params``: resident parameters (root, CPU-offloaded or quantized shards); ``gather_pool``:
    the fixed buffers layers are gathered into; ``buffers``: module buffers (rotary tables).
    """
    state = stream_state_of(model)
    if state is None:
        raise ValueError("memory_report: this model is not streamed (init_inference kept its weights resident)")
    groups = [g for gs in state.groups for g in gs]
    store = getattr(state.files, "resident_bytes", 0)
    pool = state.pool
    rep = {"params": sum(g.memory()["params"] for g in groups) + store,
           "gather_pool": pool.nbytes if pool is not None else 0,
           "buffers": sum(b.numel() * b.element_size() for b in model.buffers())}
    rep["total"] = sum(rep.values())
    rep["peak_gathered_params"] = state.fetcher.peak_gathered_bytes
    rep["gather_pool_deferred"] = pool.deferred if pool is not None else 0  # prefetches that waited for a buffer
    return ByteCounts(rep)  # a dict of ints that prints in human units
