"""Ring attention: sequence parallelism for any head count, by rotating key/value blocks.

Every rank keeps the queries of its own tokens; the key/value shards travel around the SP group
(rank r sends to r + 1 and receives from r - 1, ``N - 1`` times, each transfer started before the
block in hand is computed so that the two overlap), and each rank attends its queries to every
block as it passes. The partial results are merged exactly by the online-softmax rule: a
block's output ``o_b`` and log-sum-exp ``l_b`` combine with the running ``(o, l)`` as
``l' = logaddexp(l, l_b)``, ``o' = o·exp(l - l') + o_b·exp(l_b - l')``, in fp32. Unlike Ulysses,
nothing is split by heads, so head counts the SP degree does not divide (3 heads on 2 ranks, one
kv head on 4) and SP degrees beyond the head count are served; GQA needs no copies (a query head
group reads its kv head in place).

Causality comes from the tokens' global indices, never from the shard order: each chunk of a shard
knows where it sits in the padded sequence (``data.shard_indices``), and a (query chunk, key chunk)
pair that is wholly in the future is skipped. With the load-balanced layout (``"zigzag"``: the
sequence in ``2N`` chunks, rank r holding chunks r and 2N-1-r) every rank then computes the same
number of chunk pairs per step, instead of rank 0 idling while rank N-1 computes everything.

Backward (hand-written, flash-attention style): with the saved fp32 output and log-sum-exp, each
block's probabilities are recomputed from q·kᵀ, giving dq locally and dk/dv for the block's owner;
the dk/dv accumulators travel with their block and arrive home after ``N`` rotations. Saved per rank:
q, k, v of the shard, the fp32 output and the log-sum-exp (no ``seq²`` scores, no gathered k/v).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardwise.comm import Comm
from shardwise.sequence_parallel.data import chunks_per_shard, shard_indices

NEG = float("-inf")


def start_rotation(t: torch.Tensor, comm: Comm) -> Callable[[], torch.Tensor]:
    """Start sending ``t`` to rank r + 1 of the SP group and receiving rank r - 1's; the returned
    function waits and gives the received tensor. One asynchronous all-to-all whose only non-empty
    splits are the two ring neighbours (gloo serves uneven splits), so the transfer overlaps the
    block computed meanwhile. ``t`` must not change until the wait."""
    n, r = comm.size, comm.rank
    flat = t.contiguous().reshape(-1)
    send, recv = [0] * n, [0] * n
    send[(r + 1) % n], recv[(r - 1) % n] = flat.numel(), flat.numel()
    out = torch.empty_like(flat)
    work = comm.all_to_all_v(out, flat, recv, send, kind="ring", async_op=True)  # counted as "ring"

    def wait() -> torch.Tensor:
        work.wait()
        return out.view_as(t)

    return wait


def rotate(t: torch.Tensor, comm: Comm) -> torch.Tensor:
    """``t`` from rank r - 1 of the SP group (this rank's goes to r + 1), waited for."""
    return start_rotation(t, comm)()


def _pairs(qpos: list[torch.Tensor], kpos: list[torch.Tensor], causal: bool, device: torch.device) -> list[tuple]:
    """(query chunk, key chunk, mask or None) for every pair with something to attend (the indices
    live on the CPU, so deciding costs no device sync; a partial mask is moved to ``device``)."""
    out = []
    for a, qp in enumerate(qpos):
        for c, kp in enumerate(kpos):
            if not causal:
                out.append((a, c, None))
                continue
            mask = kp[None, :] <= qp[:, None]
            if bool(mask.all()):
                out.append((a, c, None))
            elif bool(mask.any()):
                out.append((a, c, mask.to(device)))
    return out


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [b, kv, g, sq, d] (fp32) against k [b, kv, sk, d]: [b, kv, g, sq, sk], masked with -inf."""
    s = torch.matmul(q, k.float().unsqueeze(2).transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, NEG)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output and log-sum-exp (fp32). A row with nothing visible gets lse -inf."""
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.matmul(p, v.float().unsqueeze(2)), lse


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge of two partial attentions over disjoint key sets (fp32)."""
    new = torch.logaddexp(lse, lse_b)
    safe = _finite(new)
    out = out * torch.exp(lse - safe).unsqueeze(-1) + out_b * torch.exp(lse_b - safe).unsqueeze(-1)
    return out, new


def _chunks(t: torch.Tensor, count: int) -> list[torch.Tensor]:
    return list(t.chunk(count, dim=-2))


def _positions(rank: int, comm: Comm, length: int, layout: str) -> list[torch.Tensor]:
    return list(shard_indices(rank, comm.size, length, layout).chunk(chunks_per_shard(layout)))


class RingAttention(torch.autograd.Function):
    """q [b, h, s, d], k/v [b, kv, s, d] (this rank's shard) -> attention output [b, h, s, d]."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, layout: str,  # noqa: ANN001
                scale: float, causal: bool) -> torch.Tensor:
        b, h, s, d = q.shape
        kvh, count = k.shape[1], chunks_per_shard(layout)
        qc = _chunks(q.float().reshape(b, kvh, h // kvh, s, d), count)
        qpos = _positions(comm.rank, comm, s, layout)
        outs = [torch.zeros_like(c) for c in qc]
        lses = [torch.full(c.shape[:-1], NEG, dtype=torch.float32, device=q.device) for c in qc]
        kv = torch.cat([k, v], dim=1)
        for step in range(comm.size):
            src = (comm.rank - step) % comm.size
            arriving = start_rotation(kv, comm) if step < comm.size - 1 else None  # overlaps this block
            ks, vs = _chunks(kv[:, :kvh], count), _chunks(kv[:, kvh:], count)
            for a, c, mask in _pairs(qpos, _positions(src, comm, s, layout), causal, q.device):
                outs[a], lses[a] = merge(outs[a], lses[a], *block_attention(qc[a], ks[c], vs[c], mask, scale))
            if arriving is not None:
                kv = arriving()
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.layout, ctx.scale, ctx.causal = comm, layout, scale, causal
        return out.reshape(b, h, s, d).to(q.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(ctx.comm, ctx.layout, ctx.scale, ctx.causal, q, k, v, out, lse, grad)
        return dq, dk, dv, None, None, None, None


def _block_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                 lse: torch.Tensor, do: torch.Tensor, delta: torch.Tensor) -> tuple:
    """dq, dk, dv of one (query chunk, key chunk) pair, from the final log-sum-exp (fp32)."""
    p = torch.exp(_scores(q, k, mask, scale) - _finite(lse).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)
    dp = torch.matmul(do, v.float().unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    dq = torch.matmul(ds, k.float().unsqueeze(2))
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(2)
    return dq, dk, dv


def ring_backward(comm: Comm, layout: str, scale: float, causal: bool, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor) -> tuple:
    """The ring again, now with dk/dv accumulators riding along with their k/v block (home after N hops)."""
    b, h, s, d = q.shape
    kvh, count = k.shape[1], chunks_per_shard(layout)
    do = grad.float().reshape(out.shape)
    delta = (do * out).sum(-1)
    qc, doc = _chunks(q.float().reshape(out.shape), count), _chunks(do, count)
    lc, dc = list(lse.chunk(count, dim=-1)), list(delta.chunk(count, dim=-1))
    qpos = _positions(comm.rank, comm, s, layout)
    dq = [torch.zeros_like(c) for c in qc]
    kv = torch.cat([k, v], dim=1)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    for step in range(comm.size):
        src = (comm.rank - step) % comm.size
        arriving = start_rotation(kv, comm) if step < comm.size - 1 else None  # overlaps this block
        ks, vs = _chunks(kv[:, :kvh], count), _chunks(kv[:, kvh:], count)
        dks, dvs = _chunks(dkv[:, :kvh], count), _chunks(dkv[:, kvh:], count)
        for a, c, mask in _pairs(qpos, _positions(src, comm, s, layout), causal, q.device):
            gq, gk, gv = _block_grads(qc[a], ks[c], vs[c], mask, scale, lc[a], doc[a], dc[a])
            dq[a] += gq
            dks[c] += gk  # views of dkv: the accumulator that travels with this block
            dvs[c] += gv
        dkv = rotate(dkv, comm)  # after this block's gradients are in it
        if arriving is not None:
            kv = arriving()
    dq_all = torch.cat(dq, dim=-2).reshape(b, h, s, d).to(q.dtype)
    return dq_all, dkv[:, :kvh].to(k.dtype), dkv[:, kvh:].to(v.dtype)


def layout_problem(kwargs: dict[str, Any], rank: int, size: int, length: int) -> str | None:
    """Why a model forward's inputs are not a zigzag shard (None: they are): the ring masks by the
    tokens' global indices, so a shard cut another way (contiguous, shifted positions) would be
    attended as the wrong tokens. ``split_batch`` gives ``position_ids`` = the global indices."""
    if kwargs.get("attention_mask") is not None:
        return ("ring attention: a forward got an attention_mask; split_batch removes right padding (and refuses "
                "other masks): feed its shards without a mask")
    pos = kwargs["position_ids"]
    want = shard_indices(rank, size, length, "zigzag").to(pos.device)
    if length % 2 or not bool((pos.reshape(-1, pos.shape[-1]) == want).all()):
        return (f"ring attention: rank {rank}'s position_ids are not its zigzag shard of the sequence (chunks "
                f"{rank} and {2 * size - 1 - rank} of {2 * size}); feed batches from "
                "shardwise.sequence_parallel.split_batch, whose shards follow sp.layout")
    return None


UNSUPPORTED = ("sliding_window", "softcap", "s_aux")


def ring_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, comm: Comm,
                   layout: str, **kwargs: Any) -> torch.Tensor:
    """HF's attention call served by the ring: [b, h, s, d] inputs, output [b, s, h, d].

    Refuses, in one line, what this kernel does not compute (dropout, sliding windows, softcapping,
    attention sinks) rather than ignoring it."""
    for name in UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"ring attention: the model passes {name}={kwargs[name]!r}, which ring attention "
                             "does not implement; use sequence_parallel_attention 'ulysses'")
    if kwargs.get("dropout"):
        raise ValueError(f"ring attention: attention dropout {kwargs['dropout']} is not implemented; set the "
                         "model's attention_dropout to 0")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"ring attention: {query.shape[1]} query heads are not a multiple of "
                         f"{key.shape[1]} key/value heads")
    scale = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    causal = bool(getattr(module, "is_causal", True))
    out = RingAttention.apply(query, key, value, comm, layout, float(scale), causal)
    return out.transpose(1, 2).contiguous()
