"""``shardwise.sequence_parallel``: Ulysses sequence parallelism (and ring attention) for HF causal LMs.

Each sample's sequence is split over an SP group of ranks; attention exchanges heads for tokens
(all-to-all) so every rank attends over the whole sequence with ``heads / sp`` heads; the loss
counts every token once; ZeRO (any stage) reduces over SP x DP ranks and averages over the DP
replicas only. The pieces (docs/long_context.md):

- ``SequenceParallel``: the group and the on/off rule (on whenever gradients are enabled);
- ``register_attention(model, sp)``: the attention wrapper (sdpa or eager; GQA; refusals), Ulysses
  or, for head counts Ulysses cannot split, ring attention (``ring.py``; ``choose_attention``);
- ``split_batch`` / ``SequenceSplitLoader``: a batch as this rank's shard (positions, shifted labels);
  ``GatheredSplitLoader``: every SP rank's batch in turn, each as this rank's shard;
- ``sequence_parallel_loss``: the loss of a split batch; ``router_aux_loss``: an MoE model's aux
  load-balancing term over the whole sequence (the shards' router logits gathered), to add to it;
- ``setup_sequence_parallel(model, sp_size)``: the groups plus the attention in one call (under TP,
  groups of the ranks with the same TP rank);
- ``SequenceParallelMPU``: the groups under Megatron/DeepSpeed names (``initialize(mpu=...)``);
- ALST's tiling: ``tile_mlps(model)`` (each MLP over sequence tiles, recomputed in backward) and
  ``tiled_causal_lm_loss`` (logits and loss tile by tile, never the whole ``[seq, vocab]``);
  ``offload_checkpoints(model)`` (the inputs activation checkpointing keeps, held in host memory).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardwise.layout import SequenceMesh
from shardwise.sequence_parallel.attention import choose_attention, head_split, register_attention
from shardwise.sequence_parallel.data import GatheredSplitLoader, SequenceSplitLoader, split_batch, token_mask
from shardwise.sequence_parallel.exchange import GatherShards
from shardwise.sequence_parallel.group import SequenceParallel, current
from shardwise.sequence_parallel.loss import (
    loss_of_shard_means,
    sequence_parallel_loss,
    share_of_loss,
    token_count,
)
from shardwise.sequence_parallel.mpu import SequenceParallelMPU
from shardwise.sequence_parallel.offload import HostStore, offload_checkpoints
from shardwise.sequence_parallel.router import (
    labelled_shard_loss,
    moe_causal_lm,
    router_aux_loss,
    serve_whole_sequence_aux,
    whole_sequence_aux,
)
from shardwise.sequence_parallel.tiled import tile_mlps, tiled_causal_lm_loss, tiled_loss_sum, tiled_mlp, tiled_reduce
from shardwise.tensor_parallel import tp_state_of

__all__ = ["GatherShards", "GatheredSplitLoader", "HostStore", "SequenceParallel", "SequenceParallelMPU",
           "SequenceSplitLoader",
           "choose_attention",
           "current", "head_split", "labelled_shard_loss", "loss_of_shard_means", "moe_causal_lm",
           "offload_checkpoints",
           "register_attention", "router_aux_loss", "sequence_parallel_loss", "setup_long_context",
           "serve_whole_sequence_aux", "setup_sequence_parallel", "share_of_loss", "split_batch", "tile_mlps",
           "tiled_causal_lm_loss",
           "tiled_loss_sum", "tiled_mlp", "tiled_reduce", "token_count", "token_mask", "whole_sequence_aux"]


def setup_sequence_parallel(model: nn.Module, sp_size: int, tp_size: int | None = None,
                            attention: str = "auto") -> SequenceParallel:
    """Cut the SP groups (collective) and make ``model``'s attention sequence-parallel over them.

    ``tp_size``: the tensor-parallel degree the model is (or will be) split over; None reads it from a
    model already split (``tensor_parallel.tp_state_of``), else 1. ``attention``: "auto", "ulysses"
    or "ring" (``choose_attention``)."""
    if tp_size is None:
        state = tp_state_of(model)
        tp_size = state.comm.size if state is not None else 1
    sp = SequenceParallel.of_size(sp_size, tp_size)
    if sp.size > 1:
        register_attention(model, sp, attention)
    return sp


def setup_long_context(model: nn.Module, mesh: SequenceMesh | None,
                       section: Any) -> tuple[SequenceParallel | None, HostStore | None]:
    """What the engine sets up from the config: SP over the run layout's groups ``mesh`` (None at SP 1:
    no SP) with the attention ``shardwise.sequence_parallel_attention`` asks for and, when the
    ``shardwise`` section's ``offload_activation_checkpoints`` is on, the checkpoint offload's store."""
    sp = None
    if mesh is not None and mesh.sp.size > 1:
        sp = SequenceParallel(mesh)
        register_attention(model, sp, section.sequence_parallel_attention)
    return sp, offload_checkpoints(model) if section.offload_activation_checkpoints else None
