"""Ring attention cases run on every rank of the pool (tests/test_ring_attention.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.sequence_parallel import SequenceParallel, ring
from shardwise.sequence_parallel.data import shard_indices


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _drop_second_block():
    """Make the forward ignore the block that arrives after the first rotation (a merge missing a block)."""
    plain, calls = ring._pairs, [0]

    def pairs(*args):
        calls[0] += 1
        return [] if calls[0] == 2 else plain(*args)

    ring._pairs = pairs
    return plain


def ring_matches_plain(causal: bool, seq: int, heads: int, kv_heads: int, layout: str = "zigzag",
                       inject: str | None = None) -> dict:
    """Ring attention over the pool's ranks against sdpa on the whole sequence in one process:
    the output and the q, k, v gradients of this rank's tokens (relative norm errors)."""
    sp = SequenceParallel.of_size(dist.get_world_size())
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, heads, seq, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, seq, 16, generator=g, requires_grad=True) for _ in range(2))
    grad = torch.randn(2, heads, seq, 16, generator=g)
    want = _plain(q, k, v, causal)
    want.backward(grad)
    mine = shard_indices(sp.rank, sp.size, seq // sp.size, layout)
    local = [t.detach()[:, :, mine].clone().requires_grad_(True) for t in (q, k, v)]
    plain_pairs = _drop_second_block() if inject == "drop" else None
    try:
        out = ring.RingAttention.apply(*local, sp.comm, layout, 16 ** -0.5, causal)
    finally:
        if plain_pairs is not None:
            ring._pairs = plain_pairs
    out.backward(grad[:, :, mine])
    errors = {"out": _rel(out.detach(), want.detach()[:, :, mine])}
    for name, full, part in zip("qkv", (q, k, v), local, strict=True):
        errors[name] = _rel(part.grad, full.grad[:, :, mine])
    return errors


def contiguous_shards_refused() -> str:
    """A ring-attention model fed contiguous shards (not split_batch's zigzag ones): the one-line error."""
    import sp_cases

    from shardwise.sequence_parallel import register_attention, split_batch

    sp = SequenceParallel.of_size(dist.get_world_size())
    model = sp_cases.llama(heads=3)
    register_attention(model, sp)
    assert sp.layout == "zigzag"

    class Contiguous:
        size, rank, layout = sp.size, sp.rank, "contiguous"

    shard = split_batch(sp_cases.sample_batch(2, 16), Contiguous())
    shard.pop("shift_labels")
    try:
        model(**shard)
    except ValueError as e:
        return str(e)
    return "not refused"
