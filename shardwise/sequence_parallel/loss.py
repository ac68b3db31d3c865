"""The sequence-parallel loss: every token's loss counted once, divided by the sample's token count.

Each rank sums the cross entropy of its shard's real tokens and divides by the count of real tokens
over the whole SP group (one scalar all-reduce), so the ranks' shares add up to the mean over the
whole sequences; ``SumForward`` gives every rank that sum (what the no-SP run reports), and its
backward makes the ranks' gradients ``sp`` times a replica's, which the engine's average over
all SP x DP ranks brings back to the whole loss's gradient. A per-rank mean averaged over ranks
would weight a shard with few real tokens (the padded tail of a short sample) like a full one:
wrong whenever shards differ in count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.sequence_parallel.data import IGNORE
from shardwise.sequence_parallel.exchange import SumForward
from shardwise.sequence_parallel.group import SequenceParallel


def token_count(shift_labels: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """Real (not -100) target tokens over the whole SP group, as a float scalar (at least 1)."""
    count = (shift_labels != IGNORE).sum().to(torch.float64).reshape(1)
    sp.comm.all_reduce(count)
    return count.clamp_min(1.0).squeeze(0)


def share_of_loss(loss_sum: torch.Tensor, count: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """The whole-sequence mean loss on every SP rank, from this rank's summed token losses (``SumForward``)."""
    return SumForward.apply(loss_sum / count.to(loss_sum.dtype), sp.comm)


def sequence_parallel_loss(logits: torch.Tensor, shift_labels: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """Causal-LM loss of a sequence-split batch: ``logits`` [b, s, vocab] of this shard, ``shift_labels`` [b, s]."""
    loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1),
                               ignore_index=IGNORE, reduction="sum")
    return share_of_loss(loss_sum, token_count(shift_labels, sp), sp)


def loss_of_shard_means(mean_loss: torch.Tensor, shift_labels: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """The SP group's loss from each shard's *mean* loss over its real tokens (what an HF model returns
    as ``outputs.loss`` for ``shift_labels``): ``sum_r mean_r * n_r / max(sum_r n_r, 1)`` on every rank.

    The value and the gradient convention of transformers' ``deepspeed_sp_compute_loss`` (a shard with
    no real token, whose mean is NaN, weighs nothing; the backward all-reduces over the SP group, as
    ``sequence_parallel_loss``'s does), built on ``SumForward`` instead of torch's differentiable
    ``all_gather``, whose backward on gloo fails for SP groups that do not contain rank 0."""
    good = (shift_labels != IGNORE).sum()
    weighted = torch.where(good > 0, mean_loss * good, torch.zeros_like(mean_loss))
    total = good.reshape(1).clone()
    sp.comm.all_reduce(total)
    return SumForward.apply(weighted, sp.comm) / total.squeeze(0).clamp(min=1)

