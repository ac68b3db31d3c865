"""ZeRO++ quantized collectives: block-wise int8/int4 parameter all-gather (qwZ), gradient reduce-scatter (qgZ).

Block quantization (symmetric): a tensor is cut into blocks of ``BLOCK`` elements; each block keeps
one fp32 scale ``s = max|x| / qmax`` (qmax = 127 for int8, 7 for int4) and the integers
``q = round(x / s)``, so every element comes back as ``q·s`` within ``s/2`` of its value. A block
holding an inf or NaN gets a NaN scale, so it dequantizes to NaN everywhere: an fp16 overflow is
still seen by the loss scaler instead of being hidden by the quantizer.

What one rank sends for ``S`` elements (its shard, or one destination's chunk): ``S·bits/8``
bytes of integers (int4: two per byte, rounded up) plus ``4·ceil(S/BLOCK)`` bytes of scales, in one
uint8 buffer. ``comm_stats()`` counts exactly these buffers, so with Ψ elements gathered over N
ranks an all-gather counts ``N·(S·bits/8 + 4·ceil(S/BLOCK))`` ≈ ``Ψ·(bits/8 + 4/BLOCK)`` bytes
(int8 from fp32: 0.254 of the exact 4Ψ; from bf16: 0.508 of 2Ψ).

* qwZ (``quantized_all_gather``): each rank quantizes its own shard once; the payloads are
  all-gathered and every rank dequantizes all N of them into the flat buffer, its own slice
  included, so all ranks compute with the same weights. The persistent shard and the fp32 master
  are never touched: only the gathered copy used for compute is quantized.
* qgZ (``quantized_reduce_scatter``): each rank quantizes every destination's chunk of its
  gradient once and exchanges them with one all-to-all; the receiver dequantizes the N-1 remote
  chunks and sums them with its own exact chunk in fp32. Each gradient crosses the wire quantized
  exactly once (a ring of N-1 quantized hops would requantize partial sums at every hop).
"""

from __future__ import annotations

import torch

from shardwise.comm import Comm, Work

BLOCK = 256  # elements per fp32 scale (the planner's QUANT_BLOCK; ZeRO++'s default group size)
QMAX = {8: 127, 4: 7}


def payload_bytes(numel: int, bits: int, block: int = BLOCK) -> int:
    """Bytes one quantized payload of ``numel`` elements takes: integers, then fp32 scales."""
    return _int_bytes(numel, bits) + 4 * (-(-numel // block))


def _int_bytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else -(-numel // 2)


def quantize(x: torch.Tensor, bits: int = 8, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` ([rows, S] or [S]) to (integers [rows, S] int8, scales [rows, ceil(S/block)] fp32)."""
    if bits not in QMAX:
        raise ValueError(f"quantized collectives support 8 or 4 bits, got {bits}")
    rows = x.reshape(-1, x.shape[-1])
    n, s = rows.shape
    nb = -(-s // block)
    padded = torch.zeros(n, nb * block, dtype=torch.float32, device=x.device)
    padded[:, :s].copy_(rows)
    blocks = padded.view(n, nb, block)
    absmax = blocks.abs().amax(dim=-1)
    bad = ~torch.isfinite(absmax)
    scale = absmax / QMAX[bits]
    safe = torch.where((scale > 0) & ~bad, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe.unsqueeze(-1)).clamp_(-QMAX[bits], QMAX[bits])
    q = torch.where(bad.unsqueeze(-1), torch.zeros_like(q), q)
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    return q.view(n, nb * block)[:, :s].to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Inverse of :func:`quantize` (up to the rounding): fp32 rows shaped like ``q``."""
    n, s = q.shape
    nb = scale.shape[-1]
    padded = torch.zeros(n, nb * block, dtype=torch.float32, device=q.device)
    padded[:, :s].copy_(q)
    return (padded.view(n, nb, block) * scale.unsqueeze(-1)).view(n, nb * block)[:, :s]


def pack(x: torch.Tensor, bits: int, out: torch.Tensor, block: int = BLOCK) -> None:
    """Quantize the rows of ``x`` [rows, S] into ``out`` [rows, payload_bytes(S)] (uint8)."""
    q, scale = quantize(x, bits, block)
    nq = _int_bytes(q.shape[1], bits)
    if bits == 8:
        out[:, :nq].copy_(q.view(torch.uint8))
    else:  # two nibbles per byte, stored with an offset of 8: [-7, 7] -> [1, 15]
        u = (q.to(torch.int16) + 8).to(torch.uint8)
        if u.shape[1] % 2:
            u = torch.cat([u, torch.full_like(u[:, :1], 8)], dim=1)
        out[:, :nq].copy_(u[:, 0::2] | (u[:, 1::2] << 4))
    out[:, nq:].copy_(scale.view(torch.uint8).view(scale.shape[0], -1))


def unpack(buf: torch.Tensor, numel: int, bits: int, block: int = BLOCK) -> torch.Tensor:
    """Dequantize rows of ``buf`` [rows, payload_bytes(numel)] (uint8) to fp32 [rows, numel]."""
    nq = _int_bytes(numel, bits)
    scale = buf.new_empty(buf.shape[0], buf.shape[1] - nq).copy_(buf[:, nq:]).view(torch.float32)  # aligned
    if bits == 8:
        q = buf[:, :nq].view(torch.int8)
    else:
        b = buf[:, :nq]
        q = torch.stack([b & 15, b >> 4], dim=-1).view(b.shape[0], -1)[:, :numel].to(torch.int8) - 8
    return dequantize(q, scale, block)


def quantized_all_gather(comm: Comm, shard: torch.Tensor, flat: torch.Tensor, bits: int,
                         async_op: bool = False) -> Work | None:
    """qwZ: fill ``flat`` (N·S elements) with every rank's dequantized ``shard`` (S elements).

    ``shard`` (the exact persistent copy, possibly on the CPU) is only read.
    """
    n, s = comm.size, shard.numel()
    per = payload_bytes(s, bits)
    packed = torch.empty(n * per, dtype=torch.uint8, device=flat.device)
    rows = packed.view(n, per)
    pack(shard.to(flat.device).view(1, s), bits, rows[comm.rank:comm.rank + 1])

    @torch.no_grad()
    def finish() -> None:
        flat.view(n, s).copy_(unpack(rows, s, bits))

    w = comm.all_gather(packed, async_op=async_op)
    if w is None:
        finish()
        return None
    return Work(None, comm, "all_gather", _then(w, finish))


def quantized_reduce_scatter(comm: Comm, full: torch.Tensor, out: torch.Tensor, bits: int,
                             async_op: bool = False, accumulate: bool = False) -> Work | None:
    """qgZ: ``out`` (this rank's chunk) = (or +=) the sum over ranks of their chunk of ``full``.

    Same contract as :meth:`Comm.reduce_scatter`; the remote chunks arrive block-quantized, the
    sum is taken in fp32 and cast to ``out``'s dtype once.
    """
    n, r = comm.size, comm.rank
    s = full.numel() // n
    per = payload_bytes(s, bits)
    send = torch.empty(n, per, dtype=torch.uint8, device=full.device)
    pack(full.view(n, s), bits, send)
    recv = torch.empty_like(send)
    own = full.narrow(0, r * s, s).to(torch.float32)  # exact: this chunk never leaves the rank

    @torch.no_grad()
    def finish() -> None:
        parts = unpack(recv, s, bits)
        parts[r].copy_(own)
        total = parts.sum(dim=0)
        if accumulate:
            out.add_(total.to(out.dtype))
        else:
            out.copy_(total)

    w = comm.all_to_all(recv, send, kind="reduce_scatter", async_op=async_op)
    if w is None:
        finish()
        return None
    return Work(None, comm, "reduce_scatter", _then(w, finish), after=w)  # done when the all-to-all is


def _then(work: Work, fn):
    """A finish callback that first completes ``work`` (the collective), then runs ``fn``."""
    def run() -> None:
        work.wait()
        fn()
    return run
