"""Token dispatch and combine for expert parallelism: variable all-to-all, autograd-correct.

Each EP rank holds ``E / ep`` consecutive experts. :func:`dispatch` sorts this rank's
(token, expert) pairs by expert, exchanges the per-expert counts (one small all-to-all), then
sends every pair's hidden state to the rank holding its expert (one ``all_to_all_single`` with
variable splits) and regroups what arrives so each local expert's tokens are one contiguous
block. :func:`combine` sends the expert outputs back the same way in reverse and sums each
token's ``top_k`` results with its routing weights, on the rank that routed it (so the router's
gradient stays local). The backward of each all-to-all is the reverse all-to-all. Nothing is
dropped (dropless, as the HF MoE blocks are), and a rank that receives no token still takes part
in every collective with empty tensors, so it cannot hang its peers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise.comm import Comm


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with splits; its gradient is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        ctx.comm, ctx.out_splits, ctx.in_splits = comm, out_splits, in_splits
        return exchange(x, comm, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return exchange(grad, ctx.comm, ctx.in_splits, ctx.out_splits), None, None, None


def exchange(x: torch.Tensor, comm: Comm, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Rows ``in_splits[j]`` of ``x`` go to rank j; ``out_splits[j]`` rows come from rank j (no autograd)."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    comm.all_to_all_v(out, x, out_splits, in_splits, kind="all_to_all_ep")
    return out


@dataclass
class Routed:
    """What :func:`combine` needs to undo :func:`dispatch` (one MoE layer call)."""

    order: torch.Tensor  # sorted position -> (token * top_k + slot)
    regroup: torch.Tensor  # expert-major position -> arrival position
    sent: list[int]  # pairs sent to each EP rank
    received: list[int]  # pairs received from each EP rank
    counts: list[int]  # tokens per local expert, in expert order (the blocks of the expert input)
    num_tokens: int
    top_k: int


def _arrival_to_expert_major(recv: torch.Tensor) -> torch.Tensor:
    """``recv[src, e]`` pairs arrive source-major (then by expert); the index that puts them
    expert-major (then by source), so each local expert's tokens form one block. One stable sort of
    the arrivals by (expert, source), with no host read per block."""
    src_n, local = recv.shape
    block = torch.repeat_interleave(torch.arange(src_n * local, device=recv.device), recv.reshape(-1))
    return torch.argsort((block % local) * src_n + block // local, stable=True)


def dispatch(hidden: torch.Tensor, top_k_index: torch.Tensor, num_experts: int,
             comm: Comm) -> tuple[torch.Tensor, Routed]:
    """Send each (token, expert) pair's hidden state to the EP rank holding the expert.

    ``hidden`` [T, H], ``top_k_index`` [T, k] (global expert ids). Returns the rows for this
    rank's experts, grouped by local expert (``Routed.counts`` rows each, in order), and the
    record :func:`combine` uses to bring the results back.
    """
    num_tokens, top_k = top_k_index.shape
    ep, local = comm.size, num_experts // comm.size
    ids = top_k_index.reshape(-1)
    ids_sorted, order = torch.sort(ids, stable=True)
    per_expert = torch.bincount(ids_sorted, minlength=num_experts)
    recv = exchange(per_expert.reshape(ep, local), comm, [1] * ep, [1] * ep) if ep > 1 else per_expert.reshape(1, -1)
    sent = per_expert.reshape(ep, local).sum(1).tolist()
    received = recv.sum(1).tolist()
    rows = hidden[order // top_k]
    arrived = _AllToAll.apply(rows, comm, received, sent)
    regroup = _arrival_to_expert_major(recv)
    routed = Routed(order=order, regroup=regroup, sent=sent, received=received, counts=recv.sum(0).tolist(),
                    num_tokens=num_tokens, top_k=top_k)
    return arrived[regroup], routed


def combine(expert_out: torch.Tensor, top_k_weights: torch.Tensor, routed: Routed, comm: Comm) -> torch.Tensor:
    """Bring the expert outputs (grouped as :func:`dispatch` returned them) back to the ranks that
    routed them and sum each token's ``top_k`` results weighted by ``top_k_weights`` [T, k]."""
    arrival = torch.empty_like(expert_out)
    arrival = arrival.index_copy(0, routed.regroup, expert_out)  # expert-major -> arrival order
    back = _AllToAll.apply(arrival, comm, routed.sent, routed.received)  # in this rank's sorted order
    pairs = back.new_empty(back.shape).index_copy(0, routed.order, back)  # token * top_k + slot
    pairs = pairs.view(routed.num_tokens, routed.top_k, *back.shape[1:])
    # (the weights' dtype, fp32 from the router's softmax, as the HF experts functions multiply)
    return (pairs * top_k_weights.unsqueeze(-1)).sum(dim=1).to(expert_out.dtype)
