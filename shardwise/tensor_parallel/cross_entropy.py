"""Cross-entropy over vocabulary-sharded logits, without ever building the full logits.

Each TP rank holds logits for its vocabulary slice ``[vocab_start, vocab_start + V/t)``. The loss
needs only three per-token numbers from the other ranks: the global max (for stability), the sum
of exponentials and the target's logit (held by exactly one rank). They cost two all-reduces of
``tokens`` floats instead of an all-gather of ``tokens x V``. The backward is local:
``softmax - onehot`` on this rank's slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.comm import Comm


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, tp: Comm, vocab_start: int,
                vocab_size: int, ignore_index: int) -> torch.Tensor:
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))
        n_local = x.shape[-1]
        valid_cols = max(0, min(n_local, vocab_size - vocab_start))
        if valid_cols < n_local:  # padded vocabulary columns take no part
            x = x.clone()
            x[:, valid_cols:] = float("-inf")
        m = x.max(dim=-1).values
        tp.all_reduce(m, op=dist.ReduceOp.MAX)
        x = x - m.unsqueeze(-1)
        local_t = target - vocab_start
        mine = (local_t >= 0) & (local_t < n_local) & (target != ignore_index)
        idx = local_t.clamp(0, n_local - 1)
        both = torch.stack([x.exp().sum(-1), x.gather(1, idx.unsqueeze(1)).squeeze(1) * mine])
        tp.all_reduce(both)
        sum_exp, target_logit = both[0], both[1]
        ignored = target == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        ctx.save_for_backward(x, sum_exp, idx, mine, ignored)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, sum_exp, idx, mine, ignored = ctx.saved_tensors
        grad = x.exp().div_(sum_exp.unsqueeze(-1))
        grad.scatter_add_(1, idx.unsqueeze(1), -mine.to(grad.dtype).unsqueeze(1))
        grad *= (g * ~ignored).unsqueeze(-1)
        return grad.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp: Comm, *,
                                 vocab_start: int | None = None, vocab_size: int | None = None,
                                 ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy`` of logits split on the last dim over the TP ranks.

    ``logits``: [..., V_local] this rank's slice (rank r holds columns ``r * V_local`` on, by
    default); ``target``: [...] global ids. ``vocab_size``: the true vocabulary when the last
    rank's slice is padded. ``reduction``: "mean" (over non-ignored tokens), "sum" or "none".
    """
    n_local = logits.shape[-1]
    start = tp.rank * n_local if vocab_start is None else vocab_start
    size = tp.size * n_local if vocab_size is None else vocab_size
    flat = logits.reshape(-1, n_local)
    tgt = target.reshape(-1).to(flat.device)
    loss = _VocabParallelCE.apply(flat, tgt, tp, start, size, ignore_index)
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (tgt != ignore_index).sum()


def causal_lm_loss(local_logits: torch.Tensor, labels: torch.Tensor, tp: Comm, vocab_size: int, *,
                   ignore_index: int = -100, num_items_in_batch: torch.Tensor | int | None = None,
                   shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """HF's causal-LM loss (shift by one, ignore -100, mean or sum/num_items) on sharded logits."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if num_items_in_batch is None:
        return vocab_parallel_cross_entropy(local_logits, shift_labels, tp, vocab_size=vocab_size,
                                            ignore_index=ignore_index)
    total = vocab_parallel_cross_entropy(local_logits, shift_labels, tp, vocab_size=vocab_size,
                                         ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
