"""Tensor parallelism (Megatron-style) for HF causal LMs: layers, vocab-parallel loss, plans
(TP-sliced inference from a model folder is ``shardwise.inference.tensor_parallel``)."""

from __future__ import annotations

from shardwise.tensor_parallel.cross_entropy import causal_lm_loss, vocab_parallel_cross_entropy
from shardwise.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    scatter_to_tp,
)
from shardwise.tensor_parallel.plan import (
    TPReport,
    TPState,
    apply_tensor_parallel,
    gather_param,
    gather_state_dict,
    is_tp_sharded,
    resolve_plan,
    tp_grad_norm,
    tp_state_of,
)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ShardSpec", "TPReport",
    "TPState", "tp_state_of",
    "apply_tensor_parallel", "resolve_plan", "gather_param", "gather_state_dict", "tp_grad_norm", "is_tp_sharded",
    "vocab_parallel_cross_entropy", "causal_lm_loss",
    "copy_to_tp", "reduce_from_tp", "gather_from_tp", "scatter_to_tp",
]
