"""The group-wise weight-only quantization format for streamed inference (``shardwise quantize``, ``quantize=``).

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
machinery it is just another shard store: ``quantized_store.QuantizedStore`` fills the gathered
buffer with dequantized values, a chunk at a time, so no layer-sized temporary is ever allocated; or, for a
Linear swapped for ``Int4Linear`` (int4, CPU), with the packed bytes and scales as stored.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from shardwise.inference.quantized_linear import BLOCK_ROWS, kernel_eligible, kernel_scales, to_blocked
from shardwise.zero.stage3.fetcher import assign_params, find_units

DESCRIPTION = "shardwise_quantization.json"
FORMAT_VERSION = 3  # 2: blocked weights' scales in the kernel's order and dtype; 3: block_rows (module doc)
BITS = {"int8": 8, "int4": 4}
DEFAULT_GROUP = 64


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


def check_version(path: str, version: int, blocked: set[str], rows: int) -> None:
    """Refuse a description this version would misread (see the module doc)."""
    if version > FORMAT_VERSION or version < 1:
        raise ValueError(f"{path}: format_version {version} is not one this shardwise reads (1-{FORMAT_VERSION}); "
                         "use the shardwise that wrote it, or quantize the original folder again")
    if type(rows) is not int or rows not in BLOCK_ROWS:  # (not 64.0, "32" or true)
        raise ValueError(f"{path}: block_rows {rows!r} is not one of {list(BLOCK_ROWS)}")
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


def check_args(bits: int, group: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if not isinstance(group, int) or group < 2 or group % 2:
        raise ValueError(f"group_size must be an even integer >= 2, got {group!r}")
