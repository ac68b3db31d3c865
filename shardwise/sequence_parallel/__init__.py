"""``shardwise.sequence_parallel``: Ulysses sequence parallelism (and ring attention) for HF causal LMs.

Each sample's sequence is split over an SP group of ranks; attention exchanges heads for tokens
(all-to-all) so every rank attends over the whole sequence with ``heads / sp`` heads; the loss
counts every token once; ZeRO (any stage) reduces over SP x DP ranks and averages over the DP
replicas only. The pieces (docs/long_context.md):

- ``SequenceParallel``: the group and the on/off rule (on whenever gradients are enabled);
- ``register_attention(model, sp)``: the attention wrapper (sdpa or eager; GQA; refusals), Ulysses
  or, for head counts Ulysses cannot split, ring attention (``ring.py``; ``choose_attention``);
- ``split_batch`` / ``SequenceSplitLoader``: a batch as this rank's shard (positions, shifted labels);
- ``sequence_parallel_loss``: the loss of a split batch;
- ``setup_sequence_parallel(model, sp_size)``: the groups plus the attention in one call;
- ``SequenceParallelMPU``: the groups under Megatron/DeepSpeed names (``initialize(mpu=...)``);
- ALST's tiling: ``tile_mlps(model)`` (each MLP over sequence tiles, recomputed in backward) and
  ``tiled_causal_lm_loss`` (logits and loss tile by tile, never the whole ``[seq, vocab]``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardwise.sequence_parallel.attention import choose_attention, head_split, register_attention
from shardwise.sequence_parallel.data import SequenceSplitLoader, split_batch
from shardwise.sequence_parallel.group import SequenceParallel, current
from shardwise.sequence_parallel.loss import sequence_parallel_loss, share_of_loss, token_count
from shardwise.sequence_parallel.mpu import SequenceParallelMPU
from shardwise.sequence_parallel.tiled import tile_mlps, tiled_causal_lm_loss, tiled_loss_sum, tiled_mlp, tiled_reduce

__all__ = ["SequenceParallel", "SequenceParallelMPU", "SequenceSplitLoader", "choose_attention", "current",
           "head_split", "register_attention", "sequence_parallel_from_config", "sequence_parallel_loss",
           "setup_sequence_parallel", "share_of_loss", "split_batch", "tile_mlps", "tiled_causal_lm_loss",
           "tiled_loss_sum", "tiled_mlp", "tiled_reduce", "token_count"]


def setup_sequence_parallel(model: nn.Module, sp_size: int, attention: str = "auto") -> SequenceParallel:
    """Cut the SP groups (collective) and make ``model``'s attention sequence-parallel over them
    (``attention``: "auto", "ulysses" or "ring"; see ``choose_attention``)."""
    sp = SequenceParallel.of_size(sp_size)
    if sp.size > 1:
        register_attention(model, sp, attention)
    return sp


def sequence_parallel_from_config(model: nn.Module, config: Any) -> SequenceParallel | None:
    """The engine's SP from its validated config: ``sequence_parallel_size`` ranks per group and the
    attention ``shardwise.sequence_parallel_attention`` asks for; None without SP."""
    size = config.sequence_parallel_size
    return setup_sequence_parallel(model, size, config.shardwise.sequence_parallel_attention) if size > 1 else None
