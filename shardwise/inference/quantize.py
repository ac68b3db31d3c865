"""``shardwise quantize``: write a group-wise int8/int4 copy of a ``save_pretrained`` folder, one
tensor at a time (the format: ``shardwise.inference.quant_format``; reading it:
``shardwise.inference.quantized_store``)."""

from __future__ import annotations

import json
import math
import os

import torch

from shardwise.files.model_folder import hf_output_name
from shardwise.files.safe import OutputFolder, commit_temp, hub_roots, open_temp, read_in, write_atomic
from shardwise.files.safetensors_io import ST_NAMES
from shardwise.inference.quant_format import (
    DEFAULT_GROUP,
    DESCRIPTION,
    FORMAT_VERSION,
    blocked_names,
    check_args,
    is_quantized,
    quantizable,
    scale_dtype,
    stored_form,
)
from shardwise.inference.quantized_linear import BLOCK_ROWS, write_block_rows
from shardwise.inference.stream import SafetensorsReader, meta_model


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

    ``dst`` is checked first (``files.safe.OutputFolder``): never ``src`` or inside it (also through
    a symlink), no files shardwise did not write unless ``overwrite``. Every file is written to a
    temporary name and renamed.
    """
    check_args(bits, group)
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
