"""``shardwise.sequence_parallel``: Ulysses sequence parallelism for HF causal LMs.

Each sample's sequence is split over an SP group of ranks; attention exchanges heads for tokens
(all-to-all) so every rank attends over the whole sequence with ``heads / sp`` heads; the loss
counts every token once; ZeRO (any stage) reduces over SP x DP ranks and averages over the DP
replicas only. The pieces (docs/long_context.md):

- ``SequenceParallel``: the group and the on/off rule (on whenever gradients are enabled);
- ``register_attention(model, sp)``: the attention wrapper (sdpa or eager; GQA; refusals);
- ``split_batch`` / ``SequenceSplitLoader``: a batch as this rank's shard (positions, shifted labels);
- ``sequence_parallel_loss``: the loss of a split batch; ``router_aux_loss``: an MoE model's aux
  load-balancing term over the whole sequence (the shards' router logits gathered), to add to it;
- ``setup_sequence_parallel(model, sp_size)``: the groups plus the attention in one call;
- ``SequenceParallelMPU``: the groups under Megatron/DeepSpeed names (``initialize(mpu=...)``);
- ALST's tiling: ``tile_mlps(model)`` (each MLP over sequence tiles, recomputed in backward) and
  ``tiled_causal_lm_loss`` (logits and loss tile by tile, never the whole ``[seq, vocab]``);
  ``offload_checkpoints(model)`` (the inputs activation checkpointing keeps, held in host memory).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardwise.sequence_parallel.attention import head_split, register_attention
from shardwise.sequence_parallel.data import SequenceSplitLoader, split_batch, token_mask
from shardwise.sequence_parallel.group import SequenceParallel, current
from shardwise.sequence_parallel.loss import (
    loss_of_shard_means,
    sequence_parallel_loss,
    share_of_loss,
    token_count,
)
from shardwise.sequence_parallel.mpu import SequenceParallelMPU
from shardwise.sequence_parallel.offload import HostStore, offload_checkpoints
from shardwise.sequence_parallel.router import moe_causal_lm, router_aux_loss, whole_sequence_aux
from shardwise.sequence_parallel.tiled import tile_mlps, tiled_causal_lm_loss, tiled_loss_sum, tiled_mlp, tiled_reduce

__all__ = ["HostStore", "SequenceParallel", "SequenceParallelMPU", "SequenceSplitLoader", "current", "head_split",
           "loss_of_shard_means", "offload_checkpoints", "register_attention", "router_aux_loss",
           "sequence_parallel_loss", "setup_long_context", "setup_sequence_parallel", "share_of_loss", "split_batch",
           "tile_mlps", "tiled_causal_lm_loss", "tiled_loss_sum", "tiled_mlp", "tiled_reduce", "token_count",
           "token_mask", "whole_sequence_aux", "moe_causal_lm"]


def setup_sequence_parallel(model: nn.Module, sp_size: int) -> SequenceParallel:
    """Cut the SP groups (collective) and make ``model``'s attention Ulysses attention over them."""
    sp = SequenceParallel.of_size(sp_size)
    if sp.size > 1:
        register_attention(model, sp)
    return sp


def setup_long_context(model: nn.Module, sp_size: int,
                       section: Any) -> tuple[SequenceParallel | None, HostStore | None]:
    """What the engine sets up from the config: SP over ``sp_size`` ranks (None at 1) and, when the
    ``shardwise`` section's ``offload_activation_checkpoints`` is on, the checkpoint offload's store."""
    sp = setup_sequence_parallel(model, sp_size) if sp_size > 1 else None
    return sp, offload_checkpoints(model) if section.offload_activation_checkpoints else None
