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

_MOVED = {"init_inference": "shardwise.inference.tensor_parallel"}  # name -> where it lives now


def __getattr__(name: str) -> object:
    """A name that moved out of this package is refused in one line naming its new home.

    ``init_inference`` (TP-sliced inference from a model folder) lived here before it moved to
    ``shardwise.inference.tensor_parallel``. Handing it on from here would make this package import
    ``inference/``, which imports this one: a loop between packages. So the old path is not served, and
    the ImportError (not an AttributeError, which ``from ... import`` would replace with its own words)
    says where to import it from."""
    if name in _MOVED:
        raise ImportError(f"shardwise.tensor_parallel.{name} moved: use `from {_MOVED[name]} import {name}` "
                          f"(or shardwise.init_inference(path, tensor_parallel_size=n))")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
