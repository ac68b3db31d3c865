"""DeepSpeed's Ulysses / ALST names (``deepspeed.runtime.sequence_parallel.ulysses_sp``, ``deepspeed.utils.groups``),
mapped onto ``shardwise.sequence_parallel``; what Accelerate 1.16 and transformers 5.24 call for
``ParallelismConfig(sp_size=N, sp_backend="deepspeed")``.

Where the behaviour differs from DeepSpeed 0.19.8, on purpose: SP is on whenever gradients are
enabled (``disable_in_eval`` is accepted and not needed: a no-grad forward, as evaluation and
``generate()`` run, uses the model's own attention); eager attention is served (a full causal mask
is built over the gathered sequence); sequences whose length is not a multiple of the SP degree are
padded with -100 labels instead of refused; ``TiledFusedLogitsLoss`` computes the head's gradient in
backward, so a scale applied to its output reaches it; gradients come out at their true scale at
every ZeRO stage; the HF Trainer's SP loss is served by shardwise's (``serve_trainer_sp_loss``:
transformers' own one goes through torch's differentiable ``all_gather``, whose gloo backward fails
for SP groups without rank 0, and adds an MoE model's aux loss per shard, not over the whole
sequence); the data loader adapter's shards carry ``shardwise_token_mask`` when the batch has
padding (HF models ignore an unknown keyword; the Trainer's loss takes it out).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from shardwise.deepspeed.gloo_all_gather import serve_gloo_all_gather
from shardwise.sequence_parallel import (
    GatheredSplitLoader,
    SequenceParallelMPU,
    current,
    labelled_shard_loss,
    serve_whole_sequence_aux,
    setup_sequence_parallel,
    tiled_mlp,
    tiled_reduce,
)

TOKEN_MASK = "shardwise_token_mask"  # a shard's key: the batch's real tokens as the shards lie (token_mask)


class UlyssesSPAttentionHF:
    """Only its ``register_with_transformers`` classmethod is served (what Accelerate calls)."""

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str | None,
                                   sequence_parallel_size: int, micro_batch_size: int,  # noqa: ARG003
                                   seq_length: int | None = None, seq_length_is_variable: bool = True,  # noqa: ARG003
                                   disable_in_eval: bool = False, max_length: int | None = None):  # noqa: ARG003
        """Cut the SP groups, make the model's attention Ulysses attention; the mpu for ``initialize``."""
        if sequence_parallel_size == 1:
            return None
        if not isinstance(model_name_or_path, nn.Module) or not hasattr(model_name_or_path, "config"):
            raise ValueError("register_with_transformers: shardwise needs the model object (with its config), "
                             f"not {type(model_name_or_path).__name__}; pass the model")
        model = model_name_or_path
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        active = str(config._attn_implementation or "eager").removeprefix("shardwise_sp_")
        if core_attn_implementation is not None and active != core_attn_implementation:
            raise ValueError(f"core_attn_implementation={core_attn_implementation!r} does not match the model's "
                             f"attn_implementation {active!r}; set both to the same value")
        sp = setup_sequence_parallel(model, int(sequence_parallel_size))
        serve_whole_sequence_aux(model, TOKEN_MASK)  # an MoE model's outputs.aux_loss: the whole sequence's
        serve_trainer_sp_loss()
        serve_gloo_all_gather()  # Accelerate's documented SP loop all-gathers the losses itself
        return SequenceParallelMPU(sp)


_TRAINER_LOSS = "deepspeed_sp_compute_loss"


def serve_trainer_sp_loss() -> None:
    """Replace the HF Trainer's SP loss (``transformers.trainer.deepspeed_sp_compute_loss``, the name
    ``Trainer.compute_loss`` looks up at call time) by :func:`trainer_sp_loss`, on every backend.

    Why: transformers' combines the shards' losses with torch's differentiable ``all_gather``, whose
    backward on gloo scatters with ``src=`` the group rank where torch expects a global rank, so it fails
    for every SP group that does not contain rank 0 (SP x DP); and it weights each shard's
    ``outputs.loss``, which for an MoE model holds that shard's aux loss, so the objective is not the
    no-SP run's. Idempotent; a no-op when the Trainer is not loaded."""
    for name in ("transformers.trainer", "transformers.integrations.deepspeed"):
        module = sys.modules.get(name)
        if getattr(module, _TRAINER_LOSS, None) is not None:
            setattr(module, _TRAINER_LOSS, trainer_sp_loss)


def trainer_sp_loss(accelerator: Any, model: nn.Module, inputs: dict, return_outputs: bool, pc: Any) -> Any:  # noqa: ARG001
    """transformers' ``deepspeed_sp_compute_loss`` with the no-SP objective (``labelled_shard_loss``)."""
    sp = current()
    mask = inputs.pop(TOKEN_MASK, None)
    if "labels" not in inputs and "shift_labels" in inputs:
        inputs["labels"] = inputs["shift_labels"]  # as transformers': the model computes the shard's loss
    outputs = model(**inputs)
    total = labelled_shard_loss(outputs, model, inputs["shift_labels"], mask, sp)
    return (total, outputs) if return_outputs else total


class UlyssesSPDataLoaderAdapter(GatheredSplitLoader):
    """DeepSpeed's adapter, on ``GatheredSplitLoader`` (every SP rank's batch in turn as this rank's
    shard; ``TOKEN_MASK`` when the batch has padding, for the Trainer's MoE aux loss)."""

    def __init__(self, dl: Iterable[dict], sp_rank: int, sp_group: Any, sp_world_size: int,  # noqa: ARG002
                 device: Any = None):
        sp = current()
        if sp.size != sp_world_size:
            raise ValueError(f"UlyssesSPDataLoaderAdapter: sp_world_size {sp_world_size} but the model's SP group "
                             f"has {sp.size} ranks")
        super().__init__(dl, sp, device, TOKEN_MASK)


class TiledMLP:
    """``TiledMLP.apply(fn, module, x, shards, compute_params)``: ``fn(module, x)`` over sequence tiles."""

    @staticmethod
    def apply(fn: Callable, module: nn.Module, x: torch.Tensor, shards: int,
              compute_params: list[torch.Tensor] | None = None) -> torch.Tensor:
        params = list(compute_params) if compute_params is not None else list(module.parameters())
        return tiled_mlp(lambda t: fn(module, t), x, params, int(shards))


class TiledFusedLogitsLoss:
    """``TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, compute_params, output_reduction)``."""

    @staticmethod
    def apply(fn: Callable, module: nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None,
              shards: int, compute_params: list[torch.Tensor] | None, output_reduction: str) -> torch.Tensor:
        params = list(compute_params) if compute_params is not None else list(module.parameters())
        if mask is not None and (mask.dim() != 2 or mask.shape != x.shape[:2]):
            raise ValueError("TiledFusedLogitsLoss: mask must be [batch, seq] like x")
        return tiled_reduce(lambda *a: fn(module, *a), x, y, mask, int(shards), params, output_reduction)


def sequence_parallel_group() -> Any:
    """DeepSpeed's ``groups._get_sequence_parallel_group()``: the torch group (None: the world)."""
    return current().group


def sequence_parallel_world_size() -> int:
    """DeepSpeed's ``groups._get_sequence_parallel_world_size()``."""
    return current().size


def sequence_parallel_rank() -> int:
    """DeepSpeed's ``groups._get_sequence_parallel_rank()``."""
    return current().rank
