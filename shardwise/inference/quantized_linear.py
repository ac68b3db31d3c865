"""int4 Linear layers that stay packed: torch's CPU int4 matmul kernel instead of dequantizing.

Dequantizing a streamed int4 layer into a float buffer before every use costs more CPU time than
reading the bf16 layer would (issue 12: 0.41x bf16 tokens/s). ``aten._weight_int4pack_mm_for_cpu``
multiplies bf16 activations by weights kept as 4-bit levels with one (scale, zero) per group along
the input dimension, which is exactly the group-wise symmetric format of ``shardwise.inference.quant_format``
(``w = (level - 8) * scale``, zero 0) when the groups lie along a row (``in_features`` a multiple
of the group size). The kernel wants its own byte order, which depends on the CPU torch was
built for: per block of ``R`` output rows, for each input index ``j`` ``R / 2`` bytes, byte ``r``
holding row ``r`` (low nibble) and row ``r + R / 2`` (high nibble) at ``j``; ``R`` = 64 with
AVX-512 kernels ("ROWS64"), 32 with AVX2 ones ("ROWS32"). ``shardwise quantize`` writes eligible
weights in the running torch's order and records ``R`` in the description, so a gathered layer is
used as read: no conversion, no dequantization. Both orders are defined here in plain torch (so
any machine can dequantize either) and the running torch's is found once, on a probe; where the
file's order is not it (a file written on another kind of CPU), or on GPU, those weights are
dequantized per layer as before.

The kernel also wants its scales in its own layout, ``[in / group, out, 2]`` bf16 (scale, zero)
pairs; rebuilding them from row-major fp16 scales (a transpose and a stack with zeros) on every
call cost about 5% of a streamed int4 token. So the file stores the scales of kernel-order weights
already transposed, ``[in / group, out]`` in bf16 (:func:`kernel_scales`; format 2 of
``shardwise quantize``), the store adds the zeros while it fills the gathered buffer (they are not
stored: 2 more bytes per group to read), and the kernel takes the parameter as it is.

The quantized shard store stays one store: a packed weight is streamed as two parameters of the
swapped-in :class:`Int4Linear` (the packed bytes, viewed as the model's dtype so the gather and
release machinery treats them as any float parameter, and the (scale, zero) pairs), which the
store serves under ``<weight key>_packed`` / ``<weight key>_scale``.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import nn

KERNEL_GROUPS = (32, 64, 128, 256)  # group sizes the CPU kernel accepts
BLOCK_ROWS = (64, 32)  # output rows per block of the kernel's order: AVX-512 builds, AVX2 builds
DEFAULT_BLOCK_ROWS = 64  # format-2 files (which record none), and a torch without the kernel
PACKED, SCALE = "_packed", "_scale"  # suffixes of the raw store keys of an Int4Linear's parameters


def kernel_eligible(module: nn.Module, group: int, rows: int) -> bool:
    """A Linear whose int4 weight the kernel can take as stored in blocks of ``rows`` (else: dequantized)."""
    return (isinstance(module, nn.Linear) and group in KERNEL_GROUPS and module.out_features % rows == 0
            and module.in_features % group == 0)


def to_blocked(flat: torch.Tensor, n: int, k: int, rows: int) -> torch.Tensor:
    """Packed int4 in flat order (two consecutive elements per byte, low nibble first) to the
    kernel's order in blocks of ``rows`` output rows."""
    levels = torch.stack([flat & 15, flat >> 4], dim=1).view(n // rows, 2, rows // 2, k)
    return (levels[:, 0] | (levels[:, 1] << 4)).transpose(1, 2).contiguous().view(-1)


def from_blocked(blocked: torch.Tensor, k: int, rows: int) -> torch.Tensor:
    """Inverse of :func:`to_blocked` for whole row blocks (``blocked.numel()`` a multiple of ``rows k / 2``)."""
    b = blocked.view(-1, k, rows // 2)
    out = torch.stack([b & 15, b >> 4], dim=1).transpose(2, 3).reshape(-1, k // 2, 2)
    return (out[..., 0] | (out[..., 1] << 4)).reshape(-1)


def kernel_scales(scale: torch.Tensor, n: int, k: int, group: int) -> torch.Tensor:
    """Row-major scales of an ``[n, k]`` weight (row ``r``'s groups together) to the kernel's order,
    ``[k / group, n]`` flattened, in bf16 (what the kernel computes with)."""
    return scale.view(n, k // group).t().to(torch.bfloat16).contiguous().view(-1)


def scale_pairs(kernel_order: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`kernel_scales` output to the kernel's ``[k / group, n, 2]`` (scale, 0) pairs, flattened."""
    pairs = torch.zeros(kernel_order.numel(), 2, dtype=dtype)
    pairs[:, 0] = kernel_order
    return pairs.view(-1)


def pairs_into(out: torch.Tensor, scales: torch.Tensor) -> bool:
    """:func:`scale_pairs` of the bf16 ``scales`` written into ``out`` in one op, where ``out`` is a
    4-byte aligned contiguous bf16 tensor of twice as many elements (else False, nothing written).

    A bf16 (scale, 0) pair read as one little-endian int32 is the scale's 16 bits zero-extended, so
    widening the bits (uint16 to int32) makes the pairs: 0.5-1.2 ms a token on the reader thread
    against 1.6-2.6 for a strided copy, a zero and a copy (``benchmarks/inference/bench_stream_reads.py``)."""
    if not (_LITTLE_ENDIAN and out.dtype == torch.bfloat16 and scales.dtype == torch.bfloat16
            and out.is_contiguous() and out.storage_offset() % 2 == 0 and out.numel() == 2 * scales.numel()):
        return False
    out.view(torch.int32).copy_(scales.view(torch.uint16))
    return True


_LITTLE_ENDIAN = sys.byteorder == "little"


@functools.cache
def native_block_rows() -> int | None:
    """The block rows of the running torch's int4 packing (64 or 32), found on a probe; None when
    this torch has no CPU int4 kernel or packs in an order not defined here."""
    convert = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    if convert is None or not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    n, k = 2 * max(BLOCK_ROWS), 96
    i, j = torch.arange(n)[:, None], torch.arange(k)[None, :]
    levels = ((i * 7 + j * 3 + i * j) % 16).to(torch.int32)
    flat = levels.to(torch.uint8).view(-1, 2)
    try:
        theirs = convert(levels, 1).reshape(-1)
    except RuntimeError:
        return None
    return next((r for r in BLOCK_ROWS if torch.equal(theirs, to_blocked(flat[:, 0] | (flat[:, 1] << 4), n, k, r))),
                None)


def kernel_available(rows: int | None = None) -> bool:
    """Whether the CPU int4 kernel runs here (on weights in blocks of ``rows``; None: in any order)."""
    native = native_block_rows()
    return native is not None and (rows is None or rows == native)


def write_block_rows() -> int:
    """The block rows ``shardwise quantize`` writes: the running torch's, else the AVX-512 order."""
    return native_block_rows() or DEFAULT_BLOCK_ROWS


class Int4Linear(nn.Module):
    """``nn.Linear`` whose weight is int4 in the kernel's order with group-wise scales, multiplied by the
    CPU kernel in bf16 (activations rounded to bf16, fp32 accumulation, output in the input's dtype).

    ``weight_packed`` holds the ``out * in / 2`` packed bytes viewed as ``dtype``; ``weight_scale``
    the kernel's ``[in / group, out, 2]`` (scale, 0) pairs in ``dtype`` (:func:`scale_pairs`), used
    as they are when ``dtype`` is bf16 (else converted: exact, the values are bf16).
    """

    def __init__(self, linear: nn.Linear, group: int, dtype: torch.dtype, rows: int | None = None):
        super().__init__()
        rows = rows or native_block_rows() or DEFAULT_BLOCK_ROWS
        if not kernel_eligible(linear, group, rows):
            raise ValueError(f"Int4Linear needs out_features % {rows} == 0, in_features % group == 0 and group in "
                             f"{KERNEL_GROUPS}; got {linear.out_features}x{linear.in_features}, group {group}")
        self.in_features, self.out_features, self.group = linear.in_features, linear.out_features, group
        nbytes, size = self.out_features * self.in_features // 2, torch.empty((), dtype=dtype).element_size()
        dev = linear.weight.device
        self.weight_packed = nn.Parameter(torch.empty(nbytes // size, dtype=dtype, device=dev), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(2 * self.out_features * self.in_features // group,
                                                     dtype=dtype, device=dev), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        scales_and_zeros = self.weight_scale.view(k // self.group, n, 2).to(torch.bfloat16)  # bf16: no copy
        packed = self.weight_packed.view(torch.uint8).view(n, k // 2)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, k).to(torch.bfloat16), packed, self.group,
                                                       scales_and_zeros)
        y = y.to(x.dtype).view(*x.shape[:-1], n)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, int4 packed"


def install(model: nn.Module, store: object, dtype: torch.dtype, device: torch.device) -> int:
    """Swap the Linear layers whose weights ``store`` holds in the kernel's order for :class:`Int4Linear`
    when the kernel runs here (CPU, the file's block rows this torch's); returns how many were
    swapped (0: every quantized weight is dequantized per layer instead)."""
    blocked, rows = getattr(store, "blocked", set()), getattr(store, "block_rows", DEFAULT_BLOCK_ROWS)
    if not blocked or device.type != "cpu" or not kernel_available(rows):
        return 0
    swapped = []
    for name, mod in model.named_modules():
        key = f"{name}.weight"
        if key in blocked and kernel_eligible(mod, store.group, rows):
            swapped.append((name, Int4Linear(mod, store.group, dtype, rows)))
    for name, new in swapped:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    store.packed_in_use = {f"{name}.weight" for name, _ in swapped}
    return len(swapped)
