"""Int4Linear (torch's CPU int4 kernel on weights kept packed) against dequantize-then-matmul, the
blocked byte orders (64 rows on AVX-512 builds, 32 on AVX2 ones) against torch's own packing, and
the fallback for shapes the kernel cannot take."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.inference.quant_format import dequantize_tensor, quantize_tensor
from shardwise.inference.quantized_linear import (
    BLOCK_ROWS,
    Int4Linear,
    from_blocked,
    install,
    kernel_available,
    kernel_eligible,
    kernel_scales,
    native_block_rows,
    pairs_into,
    scale_pairs,
    to_blocked,
)

needs_kernel = pytest.mark.skipif(not kernel_available(), reason="no CPU int4 kernel in an order defined here")


def _packed_linear(n: int, k: int, group: int, bias: bool, dtype: torch.dtype):
    torch.manual_seed(n + k)
    w = torch.randn(n, k) * torch.rand(n, 1)  # rows of different scales
    packed, scale = quantize_tensor(w, 4, group)
    lin = nn.Linear(k, n, bias=bias)
    m = Int4Linear(lin, group, dtype)
    m.weight_packed.data = to_blocked(packed, n, k, native_block_rows()).view(dtype)
    m.weight_scale.data = scale_pairs(kernel_scales(scale, n, k, group), dtype)
    return m, packed, scale


@pytest.mark.parametrize("rows", BLOCK_ROWS)
def test_blocked_round_trip(rows):
    flat = torch.randint(0, 256, (192 * 96 // 2,), dtype=torch.uint8)
    assert torch.equal(from_blocked(to_blocked(flat, 192, 96, rows), 96, rows), flat)


def test_block_orders_differ_and_place_rows_as_documented():
    """Byte r of input column j in a block of R rows holds row r (low nibble) and row r + R/2 (high)."""
    n, k = 128, 4
    level = lambda row: (row // 4) % 16  # noqa: E731  (distinct within a block of either size)
    flat = level(torch.arange(n))[:, None].expand(n, k).to(torch.uint8).reshape(-1, 2)
    flat = flat[:, 0] | (flat[:, 1] << 4)
    for r in BLOCK_ROWS:
        b = to_blocked(flat, n, k, r).view(n // r, k, r // 2)
        for block in range(n // r):
            first = block * r + torch.arange(r // 2)
            assert torch.equal(b[block, 1] & 15, level(first)) and torch.equal(b[block, 1] >> 4, level(first + r // 2))
    assert not torch.equal(to_blocked(flat, n, k, 64), to_blocked(flat, n, k, 32))


@needs_kernel
@pytest.mark.parametrize("n,k", [(64, 64), (192, 96), (1024, 2816)])
def test_native_order_is_torch_packing(n, k):
    levels = torch.randint(0, 16, (n, k), dtype=torch.int32)
    pairs = levels.to(torch.uint8).view(-1, 2)
    ours = to_blocked(pairs[:, 0] | (pairs[:, 1] << 4), n, k, native_block_rows())
    assert torch.equal(torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1).reshape(-1), ours)


@needs_kernel
@pytest.mark.parametrize("n,k,group,batch,bias,dtype", [(128, 256, 64, 1, False, torch.float32),
                                                        (192, 96, 32, 5, True, torch.float32),
                                                        (1024, 2816, 64, 3, False, torch.bfloat16),
                                                        (64, 512, 256, 2, False, torch.float32)])
def test_kernel_equals_dequantize_then_matmul(n, k, group, batch, bias, dtype):
    """The kernel rounds the activations and scales to bf16, multiplies the exact levels * scales
    with fp32 accumulation and rounds the result to bf16. So against the float64 product of the
    same bf16-rounded inputs with the dequantized weights, the error is at most the output's
    rounding, 2^-8 |y|, plus fp32 accumulation, k 2^-24 sum |x||w|."""
    m, packed, scale = _packed_linear(n, k, group, bias, dtype)
    x = (torch.randn(2, batch, k) * 3).to(dtype)
    y = m(x)
    assert y.dtype == dtype and y.shape == (2, batch, n)
    levels = dequantize_tensor(packed, torch.ones_like(scale), 4, group, (n, k), torch.float64)
    w = (levels.view(n, k // group, group) * scale.bfloat16().double().view(n, k // group, 1)).view(n, k)
    xb = x.bfloat16().double()
    ref, absdot = xb @ w.t(), xb.abs() @ w.abs().t()
    bound = 2.0**-8 * ref.abs() + k * 2.0**-24 * absdot
    if bias:  # added in the model's dtype after the kernel: one more rounding of the sum
        ref = ref + m.bias.double()
        bound = bound + (2.0**-24 if dtype == torch.float32 else 2.0**-8) * (ref.abs() + bound)
    assert ((y.double() - ref).abs() <= bound).all(), ((y.double() - ref).abs() - bound).max()


def test_ineligible_shapes_are_refused_not_computed():
    for n, k, group, rows in [(96, 64, 32, 64), (48, 64, 32, 32), (64, 96, 64, 64), (64, 64, 16, 32)]:
        lin = nn.Linear(k, n)
        assert not kernel_eligible(lin, group, rows)
        with pytest.raises(ValueError, match="out_features"):
            Int4Linear(lin, group, torch.float32, rows)
    assert kernel_eligible(nn.Linear(64, 96), 32, 32)  # 96 rows: whole blocks of 32, not of 64


def test_install_swaps_only_listed_eligible_linears():
    class Store:
        group, blocked, block_rows = 32, {"a.weight", "b.weight"}, native_block_rows() or 64

    model = nn.Sequential()
    model.add_module("a", nn.Linear(64, 64))
    model.add_module("b", nn.Linear(64, 80))  # listed but 80 rows, no whole block: stays a Linear
    model.add_module("c", nn.Linear(64, 64))  # not listed
    store = Store()
    other = Store()
    other.block_rows = 32 if Store.block_rows == 64 else 64  # a file written on the other kind of CPU
    spare = nn.Sequential()
    spare.add_module("a", nn.Linear(64, 64))
    assert install(spare, other, torch.float32, torch.device("cpu")) == 0 and type(spare.a) is nn.Linear
    swapped = install(model, store, torch.float32, torch.device("cpu"))
    if not kernel_available():
        assert swapped == 0 and isinstance(model.a, nn.Linear)
        return
    assert swapped == 1 and isinstance(model.a, Int4Linear)
    assert type(model.b) is nn.Linear and type(model.c) is nn.Linear
    assert store.packed_in_use == {"a.weight"}
    assert install(model, store, torch.float32, torch.device("meta")) == 0  # not on CPU: no kernel


has_kernel_ops = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
                                    or not hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"),
                                    reason="this torch has no CPU int4 kernel")


@has_kernel_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_hands_the_stored_scale_layout_to_the_kernel(dtype):
    """The scales as a format-2 file stores them (kernel_scales) and the store serves them
    (scale_pairs) are what the kernel takes, with no per-call reordering. The packed bytes here come
    from this torch's own packing, so this runs on any CPU with the kernel (in any order); bound as
    in test_kernel_equals_dequantize_then_matmul (2^-8 |y| + k 2^-24 sum |x||w|)."""
    torch.manual_seed(0)
    n, k, group = 128, 256, 64
    levels = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scale = (torch.rand(n * k // group) * 0.1 + 0.01).half()
    m = Int4Linear(nn.Linear(k, n, bias=False), group, dtype)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1).reshape(-1)
    m.weight_packed.data = packed.view(torch.uint8).view(dtype)
    m.weight_scale.data = scale_pairs(kernel_scales(scale, n, k, group), dtype)
    x = torch.randn(2, 3, k).to(dtype)
    y = m(x)
    w = (levels.double() - 8) * scale.bfloat16().double().view(n, k // group).repeat_interleave(group, 1)
    xb = x.bfloat16().double()
    ref, absdot = xb @ w.t(), xb.abs() @ w.abs().t()
    assert ((y.double() - ref).abs() <= 2.0**-8 * ref.abs() + k * 2.0**-24 * absdot).all()


def test_pairs_in_one_op_equal_the_reference_pairs():
    """The widened pairs are the (scale, 0) pairs bit for bit, negative and signed-zero scales too
    (their sign bit must not spill into the zero); where the one op cannot run nothing is written."""
    scales = torch.tensor([1.5, -2.0, 0.0, -0.0, 3e-3, -7e5, float("inf"), 1e-38], dtype=torch.bfloat16)
    out = torch.full((2 * scales.numel(),), 9.0, dtype=torch.bfloat16)
    assert pairs_into(out, scales)
    assert torch.equal(out.view(torch.int16), scale_pairs(scales, torch.bfloat16).view(torch.int16))
    odd = torch.full((2 * scales.numel() + 1,), 9.0, dtype=torch.bfloat16)[1:]  # not 4-byte aligned
    for target in (odd, torch.full((2 * scales.numel(),), 9.0), out[:-2]):
        before = target.clone()
        assert not pairs_into(target, scales)
        assert torch.equal(target, before)
