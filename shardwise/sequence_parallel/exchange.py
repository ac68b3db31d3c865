"""The two all-to-alls of Ulysses attention, as autograd functions whose backward is the other one.

Shapes follow HF attention: ``[batch, heads, seq, head_dim]``. Sequence-sharded means every rank has
all heads of its ``seq`` tokens; head-sharded means every rank has ``heads / sp`` heads of the whole
sequence (the shards concatenated in rank order). The exchange of one direction is a permutation
of the other's, so the backward of each is exactly the other: no gradient is scaled or summed here.
All ranks' shards must have the same length (the data adapter pads to a multiple of the SP degree).
"""

from __future__ import annotations

import torch

from shardwise.comm import Comm


def _seq_to_head(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    b, h, s, d = x.shape
    n = comm.size
    send = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4).contiguous()  # chunk j: heads of rank j
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send)  # chunk i: my heads of rank i's tokens
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _head_to_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    b, hl, total, d = x.shape
    n = comm.size
    send = x.reshape(b, hl, n, total // n, d).permute(2, 0, 1, 3, 4).contiguous()  # chunk j: rank j's tokens
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send)  # chunk i: rank i's heads of my tokens
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * hl, total // n, d)


class SeqToHead(torch.autograd.Function):
    """``[b, h, s, d]`` sequence-sharded -> ``[b, h/sp, sp*s, d]`` head-sharded; backward the reverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:  # noqa: ANN001
        ctx.comm = comm
        return _seq_to_head(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return _head_to_seq(grad, ctx.comm), None


class HeadToSeq(torch.autograd.Function):
    """``[b, h/sp, sp*s, d]`` head-sharded -> ``[b, h, s, d]`` sequence-sharded; backward the reverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:  # noqa: ANN001
        ctx.comm = comm
        return _head_to_seq(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return _seq_to_head(grad, ctx.comm), None


class SumForward(torch.autograd.Function):
    """All-reduce (sum) over the SP group in forward and in backward.

    Each rank's input is its tokens' share of the sample's loss; the output, on every rank, is the
    whole loss L. Every rank then back-propagates its own copy of L, so the gradient reaching a
    share is the sum of the ranks' incoming gradients (``sp`` times one rank's): the gradients of
    the SP x DP ranks are then ``sp`` times the replica's, and the ZeRO reduction averages them
    over all SP x DP ranks, as it averages plain data-parallel ranks. This is also the convention
    of the HF Trainer's and Accelerate's SP loss (a differentiable all-gather of the ranks'
    losses), so their loss gets the same, right, gradient through the facade.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:  # noqa: ANN001
        ctx.comm = comm
        out = x.detach().clone()
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        out = grad.contiguous().clone()
        ctx.comm.all_reduce(out)
        return out, None


class GatherShards(torch.autograd.Function):
    """All-gather over the SP group: ``x`` (the same shape on every rank) -> ``[sp, *x.shape]``, rank order.

    Backward: each rank gets the sum over the ranks of the gradient for its slice (a reduce-scatter),
    i.e. ``sp`` times its share when every rank computes the same function of the gathered tensor:
    ``SumForward``'s convention, so a term computed whole on every rank (the router's aux loss over
    the whole sequence) reaches the parameters at the scale the engine's SP x DP average expects.
    Built on ``Comm`` (not torch's differentiable ``all_gather``, whose gloo backward fails for SP
    groups without rank 0)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:  # noqa: ANN001
        ctx.comm, ctx.shape = comm, x.shape
        flat = x.detach().contiguous().reshape(-1)
        full = flat.new_empty(comm.size * flat.numel())
        full.narrow(0, comm.rank * flat.numel(), flat.numel()).copy_(flat)
        comm.all_gather(full)
        return full.view(comm.size, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        full = grad.contiguous().reshape(-1).clone()
        out = full.new_empty(full.numel() // ctx.comm.size)
        ctx.comm.reduce_scatter(full, out)
        return out.view(ctx.shape), None
