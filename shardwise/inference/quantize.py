"""Group-wise weight-only quantization for streamed inference (``shardwise quantize``, ``quantize=``).

At batch 1 a streamed model is bound by the bytes read per token, so the decoder layers' 2-D
weights (the Linear projections; GPT-2's Conv1D) are stored as int8 or int4 with one fp16 scale per
``group_size`` consecutive elements (symmetric: ``w ~ q * scale``, ``|q| <= 127`` or ``7``; int4
packed two per byte, low nibble first, stored as ``q + 8``). Norms, biases, embeddings and the
head stay as they are: they are small or resident, and the head and embeddings matter most for
quality.

A quantized folder (``quantize_folder``) is an ordinary safetensors file where a quantized weight
``W`` is stored as ``W`` (I8, or U8 packed) and ``W.scale`` (F16), padded to whole groups, plus
``shardwise_quantization.json`` (format version, bits, group size, original shapes and dtype, and
which int4 weights are stored in the kernel's blocked byte order of ``shardwise.inference.quantized_linear``,
``blocked``, in blocks of ``block_rows`` rows). Format 3 records ``block_rows``, the order of the
torch that wrote the file (64 on AVX-512 CPUs, 32 on AVX2 ones); format 2 wrote 64-row blocks
(``rows64``) everywhere, so on AVX2 machines the kernel never ran. Since format 2 the scales of
the blocked weights are BF16 in the kernel's order, ``[in / group, out]``
(``kernel_scales``), chosen in bf16 when quantizing, so the kernel and the dequantized path use the
same values; format 1 (no version in the description) stored them row-major in F16 and is refused
when it lists blocked weights (an int8 or a blocked-free int4 file is the same in all). To the streaming
machinery it is just another shard store: :class:`QuantizedStore` fills the gathered buffer with
dequantized values, a chunk at a time, so no layer-sized temporary is ever allocated; or, for a
Linear swapped for ``Int4Linear`` (int4, CPU), with the packed bytes and scales as stored.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading

import torch
from torch import nn

from shardwise.cli_errors import OneLineParser, bounded_int, one_line
from shardwise.inference.quantized_linear import (
    BLOCK_ROWS,
    DEFAULT_BLOCK_ROWS,
    PACKED,
    SCALE,
    from_blocked,
    kernel_eligible,
    kernel_scales,
    to_blocked,
    write_block_rows,
)
from shardwise.inference.stream import SafetensorsReader, meta_model
from shardwise.model_folder import hf_output_name
from shardwise.safe_files import OutputFolder, commit_temp, hub_roots, open_temp, read_in, write_atomic
from shardwise.safetensors_io import ST_DTYPES, ST_NAMES
from shardwise.zero.stage3 import assign_params, find_units

DESCRIPTION = "shardwise_quantization.json"
FORMAT_VERSION = 3  # 2: blocked weights' scales in the kernel's order and dtype; 3: block_rows (module doc)
BITS = {"int8": 8, "int4": 4}
DEFAULT_GROUP = 64
_CHUNK = 1 << 18  # elements dequantized at a time (bounded staging, reused)
# byte b of a packed int4 tensor holds the levels (b & 15) - 8 (first) and (b >> 4) - 8 (second)
_INT4_LEVELS = torch.tensor([[(b & 15) - 8, (b >> 4) - 8] for b in range(256)], dtype=torch.float32)


def quantize_tensor(w: torch.Tensor, bits: int, group: int,
                    scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8 values, scales)`` of ``w`` flattened and padded to whole groups; the scales in
    ``scale_dtype`` (fp16, or bf16 for the int4 kernel), the levels chosen for those rounded scales."""
    flat = w.detach().reshape(-1).float()
    groups = -(-flat.numel() // group)
    flat = torch.nn.functional.pad(flat, (0, groups * group - flat.numel())).view(groups, group)
    qmax = (1 << (bits - 1)) - 1
    scale = (flat.abs().amax(1) / qmax).to(scale_dtype)
    s = scale.float()
    q = torch.round(flat / torch.where(s > 0, s, 1.0)[:, None]).clamp_(-qmax, qmax).to(torch.int8).reshape(-1)
    if bits == 8:
        return q.view(torch.uint8).clone(), scale
    u = (q + 8).to(torch.uint8).view(-1, 2)
    return (u[:, 0] | (u[:, 1] << 4)).contiguous(), scale


def dequantize_tensor(packed: torch.Tensor, scale: torch.Tensor, bits: int, group: int,
                      shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The weight ``quantize_tensor`` stands for (whole tensor at once: for checks and references)."""
    if bits == 8:
        q = packed.view(torch.int8)
    else:
        q = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1).to(torch.int8) - 8
    w = q.view(-1, group).float() * scale.float()[:, None]
    return w.reshape(-1)[:math.prod(shape)].view(shape).to(dtype)


def scale_dtype(blocked: bool) -> torch.dtype:
    """The stored scales' dtype: bf16 (the kernel's) for blocked weights, else fp16."""
    return torch.bfloat16 if blocked else torch.float16


def stored_form(w: torch.Tensor, shape: tuple[int, ...], bits: int, group: int,
                rows: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed values, scales)`` of ``w`` as a file holds them; ``rows``: blocked in the kernel's order
    in blocks of that many rows (the scales too), None: flat."""
    packed, scale = quantize_tensor(w, bits, group, scale_dtype(rows is not None))
    if rows is not None:
        return to_blocked(packed, *shape, rows), kernel_scales(scale, *shape, group)
    return packed, scale


def _check_version(path: str, version: int, blocked: set[str], rows: int) -> None:
    """Refuse a description this version would misread (see the module doc)."""
    if version > FORMAT_VERSION or version < 1:
        raise ValueError(f"{path}: format_version {version} is not one this shardwise reads (1-{FORMAT_VERSION}); "
                         "use the shardwise that wrote it, or quantize the original folder again")
    if rows not in BLOCK_ROWS:
        raise ValueError(f"{path}: block_rows {rows} is not one of {list(BLOCK_ROWS)}")
    if version < 2 and blocked:
        raise ValueError(f"{path}: format 1 (an older shardwise) stores the scales of its int4 kernel weights "
                         "row-major in F16; format 2 keeps them in the kernel's order in BF16. Quantize the "
                         "original folder again: shardwise quantize SRC DST --bits 4")


def quantizable(model: nn.Module) -> set[str]:
    """Names of the 2-D weights inside decoder layers (every unit but the root)."""
    units = find_units(model)
    params = assign_params(model, units)
    ids = {id(p) for ui in range(len(units) - 1) for p in params[ui] if p.dim() == 2}
    return {n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}


def blocked_names(model: nn.Module, names: set[str], bits: int, group: int, rows: int) -> set[str]:
    """The int4 weights among ``names`` stored in the kernel's order in blocks of ``rows`` (Linear,
    shapes it takes)."""
    if bits != 4:
        return set()
    return {n for n in names
            if n.endswith(".weight") and kernel_eligible(model.get_submodule(n[:-7]), group, rows)}


def is_quantized(folder: str | os.PathLike) -> bool:
    return os.path.exists(os.path.join(folder, DESCRIPTION))


def _check_args(bits: int, group: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if not isinstance(group, int) or group < 2 or group % 2:
        raise ValueError(f"group_size must be an even integer >= 2, got {group!r}")


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
        _check_args(bits, group)
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
            rows = int(desc.get("block_rows", DEFAULT_BLOCK_ROWS)) if version >= 3 else DEFAULT_BLOCK_ROWS
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a valid quantization description ({type(e).__name__}: {e})") from None
        _check_version(path, version, blocked, rows)
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
    def resident_bytes(self) -> int:
        return sum(q.numel() + s.numel() * 2 for q, s in self.blobs.values())

    def _raw_key(self, name: str) -> tuple[str, bool] | None:
        """``(weight key, is scale)`` for an Int4Linear parameter's store key, else None."""
        for suffix, scale in ((PACKED, False), (SCALE, True)):
            if name.endswith(suffix) and name[:-len(suffix)] in self.packed_in_use:
                return name[:-len(suffix)], scale
        return None

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
            self._dequantize(name, start, end, out)
        return out

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


def _copy_side_files(src: str, dst: str) -> list[str]:
    """Copy config, tokenizer and generation config (every top-level file but the weights and
    hidden files), each confined to ``src`` and read as a regular file; returns their names."""
    names = []
    for name in sorted(os.listdir(src)):
        if (name.startswith(".") or name.endswith(".safetensors") or name == "model.safetensors.index.json"
                or name == DESCRIPTION or os.path.isdir(os.path.join(src, name))):
            continue
        write_atomic(os.path.join(dst, name), read_in(src, name, also=hub_roots(src)))
        names.append(name)
    return names


def _quantized_header(files: SafetensorsReader, order: list[str], names: set[str], blocked: set[str], bits: int,
                      group: int) -> tuple[dict, dict[str, list[int]], str | None]:
    """The output's safetensors header (tensors in ``order``; each quantized one as its packed values
    and scales), the quantized tensors' original shapes, and their dtype's name."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt", "quantized_by": "shardwise"}}
    offset, shapes, dtype = 0, {}, None
    for key in order:
        shape, st = files.tensors[key].shape, ST_NAMES[files.tensors[key].dtype]
        if key in names:
            shapes[key], dtype = list(shape), dtype or st
            groups = -(-math.prod(shape) // group)
            parts = [(key, "I8" if bits == 8 else "U8", groups * group * bits // 8, 1),
                     (f"{key}.scale", ST_NAMES[scale_dtype(key in blocked)], groups, 2)]
        else:
            parts = [(key, st, math.prod(shape), files.tensors[key].dtype.itemsize)]
        for name, kind, numel, size in parts:
            header[name] = {"dtype": kind, "shape": list(shape) if name == key and key not in names else [numel],
                            "data_offsets": [offset, offset + numel * size]}
            offset += numel * size
    return header, shapes, dtype


def quantize_folder(src: str, dst: str, bits: int, group: int = DEFAULT_GROUP, overwrite: bool = False,
                    block_rows: int | None = None) -> dict:
    """Write a quantized copy of the ``save_pretrained`` folder ``src`` to ``dst``, one tensor at a time.

    ``block_rows``: the int4 kernel order to write (64: AVX-512 CPUs, 32: AVX2 ones); default the
    running torch's, so the machine that quantizes runs the kernel on the file.

    ``dst`` is checked first (``safe_files.OutputFolder``): never ``src`` or inside it (also through
    a symlink), no files shardwise did not write unless ``overwrite``. Every file is written to a
    temporary name and renamed.
    """
    _check_args(bits, group)
    rows = block_rows or write_block_rows()  # the running torch's kernel order (module doc)
    if rows not in BLOCK_ROWS:
        raise ValueError(f"block_rows must be one of {list(BLOCK_ROWS)}, got {rows}")
    guard = OutputFolder(dst, "DST", inputs=[src], overwrite=overwrite,
                         ours=lambda n: hf_output_name(n) or n == DESCRIPTION)
    if is_quantized(src):
        raise ValueError(f"{src} is already quantized; quantize the original folder")
    model, _ = meta_model(src, None)
    files = SafetensorsReader(src)
    names = quantizable(model)
    blocked = blocked_names(model, names, bits, group, rows)
    order = sorted(files.tensors, key=lambda k: (files.file_of[k].path, files.tensors[k].offset))
    header, shapes, dtype = _quantized_header(files, order, names, blocked, bits, group)
    out = guard.prepare() / "model.safetensors"
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open_temp(out) as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for key in order:
            t = files.read(key, 0, files.tensors[key].numel)
            pieces = (stored_form(t, files.tensors[key].shape, bits, group, rows if key in blocked else None)
                      if key in names else (t,))
            for piece in pieces:
                f.write(piece.reshape(-1).view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    commit_temp(out)
    files.close()
    written = ["model.safetensors", DESCRIPTION, *_copy_side_files(src, dst)]
    desc = {"format": "shardwise-groupwise-symmetric", "format_version": FORMAT_VERSION, "bits": bits,
            "group_size": group, "scale_dtype": "F16", "blocked_scales": "BF16 [in / group, out]",
            "dtype": dtype or "F32", "tensors": shapes, "blocked": sorted(blocked), "block_rows": rows}
    write_atomic(os.path.join(dst, DESCRIPTION), json.dumps(desc, indent=1).encode())
    guard.finish(written)
    before = sum(f.size for f in files.files)
    return {"tensors_quantized": len(shapes), "bytes_before": before,
            "bytes_after": os.path.getsize(os.path.join(dst, "model.safetensors"))}


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="shardwise quantize", formatter_class=argparse.RawDescriptionHelpFormatter,
                      description="Write a group-wise int8/int4 copy of a save_pretrained folder for "
                                  "streamed inference (init_inference / generate --offload).",
                      epilog="examples:\n  shardwise quantize llama_dir llama_int4 --bits 4\n"
                             "  shardwise generate --model llama_int4 --prompt Hi --offload disk")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--bits", type=int, choices=[8, 4], required=True)
    p.add_argument("--group-size", type=bounded_int(1, 1 << 20, "--group-size"), default=DEFAULT_GROUP,
                   help=f"elements per scale (default {DEFAULT_GROUP})")
    p.add_argument("--kernel-order", type=int, choices=list(BLOCK_ROWS), default=None,
                   help="int4: rows per block of the CPU kernel's byte order to write (64: AVX-512 machines, "
                        f"32: AVX2 ones; default this machine's, {write_block_rows()})")
    p.add_argument("--overwrite", action="store_true",
                   help="DST may hold other files: replace only the files quantize writes there")
    args = p.parse_args(argv)
    try:
        rep = quantize_folder(args.src, args.dst, args.bits, args.group_size, overwrite=args.overwrite,
                              block_rows=args.kernel_order)
    except (ValueError, OSError) as e:
        print(f"shardwise quantize: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(f"{args.dst}: {rep['tensors_quantized']} weights to {args.bits} bits (groups of {args.group_size}); "
          f"{rep['bytes_before'] / 2**20:.1f} MiB -> {rep['bytes_after'] / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
