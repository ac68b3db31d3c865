"""Ulysses attention that keeps its output once: the exchange and the attention recomputed in backward.

Why: under Ulysses a layer's attention output lived twice until backward, head-sharded
(``[b, h/N, S, d]``, kept by sdpa for its backward) and, after the exchange back,
sequence-sharded (kept by ``o_proj`` as its input); without SP the two are one storage. And with
``N`` above the kv heads each rank kept a whole copy of a kv head. So the activations per rank
were more than ``1/N`` of the no-SP ones. Here the autograd function keeps only its inputs, the
sequence-sharded q, k, v (the kv heads not yet copied); backward exchanges them again, reruns the
attention with gradients and back-propagates through it. What is saved per layer is then ``1/N``
of the no-SP run's, at the price of one more attention forward and three more all-to-alls per
layer in backward (as activation checkpointing of the attention alone would cost).

Exact: the recompute runs the same kernels on bitwise the same inputs (the exchanges move bits),
so the gradients are those of the saved forward. Attention dropout would draw other masks in the
recompute: the caller keeps the plain path for it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardwise.comm import Comm
from shardwise.sequence_parallel.exchange import HeadToSeq, SeqToHead

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def heads_out(attend: Attend, comm: Comm, copies: int, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> torch.Tensor:
    """Sequence-sharded ``[b, heads, s, d]`` q, k, v -> the head-sharded output ``[b, h/N, S, d]``."""
    if copies > 1:
        k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
    qh, kh, vh = (SeqToHead.apply(t, comm) for t in (q, k, v))
    return attend(qh, kh, vh)


class SavedOnceAttention(torch.autograd.Function):
    """``[b, h, s, d]`` sequence-sharded q, k, v -> the sequence-sharded output ``[b, h, s, d]``;
    saves q, k, v alone (see the module docstring)."""

    @staticmethod
    def forward(ctx, attend: Attend, comm: Comm, copies: int, q: torch.Tensor, k: torch.Tensor,  # noqa: ANN001
                v: torch.Tensor) -> torch.Tensor:
        ctx.attend, ctx.comm, ctx.copies = attend, comm, copies
        ctx.save_for_backward(q, k, v)
        return HeadToSeq.apply(heads_out(attend, comm, copies, q, k, v), comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[3:],
                                                                   strict=True)]
        with torch.enable_grad():
            out = heads_out(ctx.attend, ctx.comm, ctx.copies, *inputs)
        with torch.no_grad():
            grad_heads = SeqToHead.apply(grad.contiguous(), ctx.comm)
        wanted = [t for t in inputs if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad_heads)) if wanted else iter(())
        return (None, None, None, *(next(got) if t.requires_grad else None for t in inputs))


def saved_once_attention(attend: Attend, comm: Comm, copies: int, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor) -> torch.Tensor:
    """The sequence-sharded attention output of sequence-sharded q, k, v (``copies``: of each kv head,
    ``head_split``'s), keeping only q, k, v for backward."""
    return SavedOnceAttention.apply(attend, comm, copies, q, k, v)
