"""The shard store of a quantized model: reads dequantize into the gathered buffer (format: ``quant_format.py``)."""

from __future__ import annotations

import json
import math
import os
import threading

import torch
from torch import nn

from shardwise.files.safe import read_in
from shardwise.files.safetensors_io import ST_DTYPES, ST_NAMES
from shardwise.inference.quant_format import (
    BITS,
    DEFAULT_GROUP,
    DESCRIPTION,
    blocked_names,
    check_args,
    check_version,
    is_quantized,
    quantizable,
    scale_dtype,
    stored_form,
)
from shardwise.inference.quantized_linear import (
    DEFAULT_BLOCK_ROWS,
    PACKED,
    SCALE,
    from_blocked,
    pairs_into,
    write_block_rows,
)
from shardwise.inference.stream import SafetensorsReader

_CHUNK = 1 << 18  # elements dequantized at a time (bounded staging, reused)
# byte b of a packed int4 tensor holds the levels (b & 15) - 8 (first) and (b >> 4) - 8 (second)
_INT4_LEVELS = torch.tensor([[(b & 15) - 8, (b >> 4) - 8] for b in range(256)], dtype=torch.float32)


class QuantizedStore(SafetensorsReader):
    """A shard store whose quantized tensors are dequantized into the gathered buffer.

    ``resident=True`` (``offload="cpu"``): the packed values and scales are kept in memory,
    taken from a quantized folder or made at load from a plain one; else they are ``pread``
    from the quantized folder at every gather. Other tensors read as from any folder.
    """

    def __init__(self, folder: str, bits: int, group: int, shapes: dict[str, tuple[int, ...]],
                 dtype: torch.dtype, resident: bool, from_plain: bool = False, blocked: set[str] = frozenset(),
                 block_rows: int = DEFAULT_BLOCK_ROWS):
        super().__init__(folder)
        check_args(bits, group)
        self.bits, self.group, self.qshapes, self.qdtype = bits, group, shapes, dtype
        self.blocked, self.packed_in_use = set(blocked), set()  # the latter: set by quantized_linear.install
        self.block_rows = block_rows
        for key in self.blocked:
            shape = shapes.get(key, ())
            if bits != 4 or len(shape) != 2 or shape[0] % block_rows or shape[1] % group:
                raise ValueError(f"{folder}/{DESCRIPTION}: {key!r} ({list(shape)}) is listed as blocked but only "
                                 f"int4 [out, in] weights with out % {block_rows} == 0 and in % {group} == 0 can be")
        self.blobs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, shape in shapes.items():
            if from_plain:
                self.blobs[key] = stored_form(super().read(key, 0, math.prod(shape)), shape, bits, group,
                                              block_rows if key in self.blocked else None)
            else:
                self._check_stored(key, shape)
                if resident:
                    self.blobs[key] = self._load_blob(key)
        self.holds_layers = resident  # the groups re-read from here: no second, dequantized copy
        self._qlock = threading.Lock()
        self._stage: dict[str, torch.Tensor] = {}
        widest = max((self.block_rows * shapes[k][1] for k in self.blocked), default=0)
        self._block_values = torch.empty(widest, dtype=dtype)  # _from_block_cache's one block
        self._cached_block: tuple[str, int] | None = None

    @classmethod
    def open(cls, folder: str, resident: bool) -> QuantizedStore:
        path = os.path.join(folder, DESCRIPTION)
        try:
            desc = json.loads(read_in(folder, DESCRIPTION))
            version = int(desc.get("format_version", 1))
            bits, group = int(desc["bits"]), int(desc["group_size"])
            shapes = {k: tuple(int(d) for d in v) for k, v in desc["tensors"].items()}
            dtype = ST_DTYPES[desc["dtype"]]
            blocked = {str(k) for k in desc.get("blocked", desc.get("rows64", []))}
            rows = desc.get("block_rows", DEFAULT_BLOCK_ROWS) if version >= 3 else DEFAULT_BLOCK_ROWS
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a valid quantization description ({type(e).__name__}: {e})") from None
        check_version(path, version, blocked, rows)
        return cls(folder, bits, group, shapes, dtype, resident, blocked=blocked, block_rows=rows)

    def _check_stored(self, key: str, shape: tuple[int, ...]) -> None:
        groups = -(-math.prod(shape) // self.group)
        want = {key: (torch.uint8 if self.bits == 4 else torch.int8, groups * self.group * self.bits // 8),
                f"{key}.scale": (scale_dtype(key in self.blocked), groups)}
        for name, (dtype, numel) in want.items():
            got = self.tensors.get(name)
            if got is None or got.dtype != dtype or got.numel != numel:
                raise ValueError(f"{self.folder}: quantized tensor {name!r} should be {ST_NAMES[dtype]} of {numel} "
                                 f"elements for {self.bits}-bit groups of {self.group} of shape {list(shape)}; "
                                 f"found {list(got.shape) if got else None} {got.dtype if got else 'nothing'}")

    def _load_blob(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for name in (key, f"{key}.scale"):
            t = torch.empty(self.tensors[name].numel, dtype=self.tensors[name].dtype)
            self.read_raw(name, 0, t)
            out.append(t.view(torch.uint8) if name == key else t)
        return out[0], out[1]

    @property
    def staging_bytes(self) -> int:
        """Bytes of the reused dequantization buffers (made on first use, as large as the largest
        tensor needs; the streamed-memory bound counts them)."""
        return sum(t.numel() * t.element_size() for t in (*self._stage.values(), self._block_values))

    @property
    def resident_bytes(self) -> int:
        return sum(q.numel() + s.numel() * 2 for q, s in self.blobs.values())

    def _raw_key(self, name: str) -> tuple[str, bool] | None:
        """``(weight key, is scale)`` for an Int4Linear parameter's store key, else None."""
        for suffix, scale in ((PACKED, False), (SCALE, True)):
            if name.endswith(suffix) and name[:-len(suffix)] in self.packed_in_use:
                return name[:-len(suffix)], scale
        return None

    def position(self, name: str, start: int) -> tuple[int, int]:
        """Where a read of ``name`` begins in the files: its packed bytes, or its scales (the start
        of the tensor: a layer's reads are ordered by tensor, whole tensors at a time). Weights
        held in memory (``blobs``) read no file: they come first."""
        raw = self._raw_key(name)
        key = raw[0] if raw is not None else name
        if key in self.blobs:
            return -1, 0
        if raw is not None:
            return super().position(f"{raw[0]}.scale" if raw[1] else raw[0], 0)
        return super().position(name, start if name not in self.qshapes else 0)

    def find(self, names: list[str]) -> str:
        for n in names:
            if n in self.qshapes or self._raw_key(n) is not None:
                return n
        return super().find(names)

    def check_shape(self, key: str, shape: tuple[int, ...], floating: bool = True) -> None:
        raw = self._raw_key(key)
        if raw is not None:  # Int4Linear sizes its parameters from the same shape: only the key matters
            return
        if key not in self.qshapes:
            return super().check_shape(key, shape, floating)
        if tuple(self.qshapes[key]) != tuple(shape):
            raise ValueError(f"{self.folder}/{DESCRIPTION}: quantized tensor {key!r} has shape "
                             f"{list(self.qshapes[key])} but {self.folder}/config.json makes it {list(shape)}: "
                             "config and weights do not match")

    def read(self, name: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        raw = self._raw_key(name)
        if raw is not None:
            return self._read_raw(*raw, start, end, out)
        if name not in self.qshapes:
            return super().read(name, start, end, out)
        if out is None:
            out = torch.empty(end - start, dtype=self.qdtype)
        with self._qlock:  # one set of staging buffers (the reader thread and a sync gather)
            if not self._from_block_cache(name, start, end, out):
                self._dequantize(name, start, end, out)
        return out

    def _from_block_cache(self, key: str, start: int, end: int, out: torch.Tensor) -> bool:
        """A range inside one row block of a blocked weight, served from that block dequantized once.

        A row-parallel tensor-parallel slice is read one row at a time, and each row of a blocked
        weight needs its whole 32- or 64-row block read and dequantized: without this, a weight
        was read and dequantized ``block_rows`` times over. The last block stays until another is
        asked for (one block: ``block_rows * in`` elements). False: not such a range.
        """
        if key not in self.blocked:
            return False
        width = self.block_rows * self.qshapes[key][1]
        block = start // width
        if end - start >= width or (end - 1) // width != block:
            return False
        if self._cached_block != (key, block):
            self._cached_block = None  # a failed read must not leave a stale block marked valid
            self._dequantize(key, block * width, (block + 1) * width, self._block_values[:width])
            self._cached_block = (key, block)
        out.copy_(self._block_values[start - block * width:end - block * width])
        return True

    def _read_raw(self, key: str, scale: bool, start: int, end: int, out: torch.Tensor | None) -> torch.Tensor:
        """Elements [start, end) of an Int4Linear parameter: the packed bytes (any dtype's view of
        them) as stored, or its kernel-layout (scale, 0) pairs made from the stored scales (element
        ``2 i`` is stored scale ``i``, ``2 i + 1`` a zero), in ``out``'s dtype."""
        if out is None:
            out = torch.empty(end - start, dtype=torch.bfloat16 if scale else torch.uint8)
        if not scale:
            size = out.element_size()
            self._raw(key, False, start * size, out.view(torch.uint8))
            return out
        lo, hi = start // 2, -(-end // 2)
        with self._qlock:
            staged = self._buf("raw_scales", hi - lo, torch.bfloat16)
            self._raw(key, True, lo, staged)
            if start % 2 == 0 and pairs_into(out, staged):
                return out
            pairs = self._buf(f"scale_pairs_{out.dtype}", 2 * (hi - lo), out.dtype).view(-1, 2)
            pairs[:, 0].copy_(staged)
            pairs[:, 1].zero_()
            out.copy_(pairs.view(-1)[start - 2 * lo:end - 2 * lo])
        return out

    def _buf(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if name not in self._stage or self._stage[name].numel() < numel:
            self._stage[name] = torch.empty(numel, dtype=dtype)
        return self._stage[name][:numel]

    def _raw(self, key: str, scale: bool, lo: int, dst: torch.Tensor) -> None:
        """Elements [lo, lo + len(dst)) of the packed values (``scale=False``) or the scales."""
        if key in self.blobs:
            dst.copy_(self.blobs[key][int(scale)][lo:lo + dst.numel()])
            return
        name = f"{key}.scale" if scale else key
        self.read_raw(name, lo * dst.element_size(), dst)

    def _dequantize(self, key: str, start: int, end: int, out: torch.Tensor) -> None:
        """Fill ``out`` with elements [start, end): whole groups a chunk at a time, no temporaries
        beyond the fixed staging buffers. From disk the packed bytes and scales of the whole range
        are read first, in one read each: chunk-sized reads were thousands of small (cold: evicted,
        so real) I/Os per token, 5x slower than the dequantization itself (int8, issue 12)."""
        g, per_byte = self.group, 8 // self.bits
        chunk, first, stop = max(1, _CHUNK // g), start // g, -(-end // g)
        if key in self.blocked:  # whole row blocks: the same bytes in both orders, reordered here
            block = self.block_rows * self.qshapes[key][1] // g
            chunk, first, stop = -(-chunk // block) * block, first // block * block, -(-stop // block) * block
        packed = self._buf("packed", chunk * g // per_byte, torch.uint8)
        index = self._buf("index", chunk * g // per_byte, torch.int32)
        scales32 = self._buf("scales32", chunk, torch.float32)
        vals = self._buf("vals", chunk * g, torch.float32)
        if key in self.blobs:
            all_q = self.blobs[key][0][first * g // per_byte:]
        else:  # bounded by the largest quantized tensor's packed bytes, kept for reuse
            all_q = self._buf("range_packed", (stop - first) * g // per_byte, torch.uint8)
            self._raw(key, False, first * g // per_byte, all_q)
        all_s = self._row_major_scales(key, first, stop)
        for ga in range(first, stop, chunk):
            n = min(chunk, stop - ga)
            q = packed[:n * g // per_byte]
            q.copy_(all_q[(ga - first) * g // per_byte:(ga - first + n) * g // per_byte])
            if key in self.blocked:
                q.copy_(from_blocked(q, self.qshapes[key][1], self.block_rows))
            scales32[:n].copy_(all_s[ga - first:ga - first + n])
            if self.bits == 8:
                torch.mul(q.view(torch.int8).view(n, g), scales32[:n, None], out=vals[:n * g].view(n, g))
            else:  # each byte to its two levels through a 256-entry table: one gather, no strided writes
                index[:q.numel()].copy_(q)
                torch.index_select(_INT4_LEVELS, 0, index[:q.numel()], out=vals[:n * g].view(-1, 2))
                vals[:n * g].view(n, g).mul_(scales32[:n, None])
            lo, hi = max(start, ga * g), min(end, (ga + n) * g)
            out[lo - start:hi - start].copy_(vals[lo - ga * g:hi - ga * g])


    def _row_major_scales(self, key: str, first: int, stop: int) -> torch.Tensor:
        """Scales of groups [first, stop) in row-major order. Blocked weights store theirs in the kernel's
        ``[in / group, out]`` order, and the range is whole rows: those columns, transposed."""
        if key not in self.blocked:
            if key in self.blobs:
                return self.blobs[key][1][first:stop]
            out = self._buf("range_scales", stop - first, torch.float16)
            self._raw(key, True, first, out)
            return out
        n, kg = self.qshapes[key][0], self.qshapes[key][1] // self.group
        if key in self.blobs:
            kernel_order = self.blobs[key][1]
        else:  # every column is one read; bounded by the largest tensor's scales
            kernel_order = self._buf("kernel_scales", n * kg, torch.bfloat16)
            self._raw(key, True, 0, kernel_order)
        out = self._buf("range_scales_blocked", stop - first, torch.bfloat16)
        out.view(-1, kg).copy_(kernel_order.view(kg, n)[:, first // kg:stop // kg].t())
        return out


def open_store(path: str, model: nn.Module, offload: str | None, quantize: str | None,
               group_size: int | None) -> SafetensorsReader:
    """The shard store for ``init_inference``: plain, a quantized folder, or quantized at load."""
    if quantize is not None and quantize not in BITS:
        raise ValueError(f"quantize must be one of {sorted(BITS)} or None, got {quantize!r}")
    if is_quantized(path):
        store = QuantizedStore.open(path, resident=offload == "cpu")
        if quantize is not None and BITS[quantize] != store.bits:
            raise ValueError(f"{path} is quantized to {store.bits} bits but quantize={quantize!r} was asked")
        if group_size is not None and group_size != store.group:
            raise ValueError(f"{path} has groups of {store.group}, not group_size={group_size}")
        return store
    if quantize is None:
        return SafetensorsReader(path)
    if offload != "cpu":
        raise ValueError(f"quantize={quantize!r} with offload={offload!r} streams a quantized copy from disk: "
                         f"write it once with `shardwise quantize {path} DST --bits {BITS[quantize]}` and pass DST")
    plain = SafetensorsReader(path)
    names = quantizable(model)
    shapes = {plain.find([n]): plain.tensors[plain.find([n])].shape for n in names}
    dtype = next((plain.tensors[k].dtype for k in shapes), torch.float32)
    plain.close()
    group = group_size or DEFAULT_GROUP
    rows = write_block_rows()
    blocked = {plain.find([n]) for n in blocked_names(model, names, BITS[quantize], group, rows)}
    return QuantizedStore(path, BITS[quantize], group, shapes, dtype, True, from_plain=True, blocked=blocked,
                          block_rows=rows)
