"""DeepSpeed's Ulysses SP and ALST pieces for bench_long_context_worker.py (needs ``deepspeed`` installed).

Used the way DeepSpeed's ALST recipe and the HF Trainer use them, without an engine (activation bytes
do not depend on the ZeRO stage, which only places weights, gradients and optimizer state):

- attention: ``UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", N, 1)`` (SP > 1);
- data: ``UlyssesSPDataLoaderAdapter`` over a one-batch loader (every rank gets its shard of the
  same sample, with ``shift_labels``);
- loss untiled: the model's ``loss_function`` on this shard's logits and ``shift_labels``, then the
  Trainer's SP recipe: the ranks' losses all-gathered (differentiable) and weighted by their counts
  of real tokens;
- tiled: each decoder layer's MLP through ``TiledMLP.apply`` and the LM head + cross entropy
  through ``TiledFusedLogitsLoss.apply`` (summed over tiles, divided by the shard's real tokens),
  with the same tile counts as shardwise's (one tile per ``hidden`` tokens).

DeepSpeed's ``TiledFusedLogitsLoss`` does not pass a scale on its output to the LM head's gradient
(docs/long_context.md); that changes gradients, not the bytes measured here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100


class DeepSpeedSP:
    name = "deepspeed"

    def __init__(self, sp_size: int, tiles_for: Callable[[int], int]):
        """``tiles_for``: the worker's tile count for a local sequence length, handed in (not imported back
        from the worker, which imports this file) so both implementations tile the same way."""
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        self.size, self.mpu, self.version = sp_size, None, deepspeed.__version__
        self.tiles_for = tiles_for

    def prepare(self, model: nn.Module, tiled: bool) -> None:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        if self.size > 1 and self.mpu is None:  # it rewrites transformers' global "sdpa": once per process
            self.mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", self.size, 1)
        if tiled:
            for layer in model.model.layers:
                _tile_mlp(layer.mlp, self.tiles_for)

    def shard(self, batch: dict) -> tuple[dict, torch.Tensor]:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        if self.mpu is None:
            shift = F.pad(batch["labels"], (0, 1), value=IGNORE)[:, 1:].contiguous()
            return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}, shift
        group = self.mpu.get_sequence_parallel_group()
        loader = torch.utils.data.DataLoader([batch], batch_size=None)
        adapter = UlyssesSPDataLoaderAdapter(loader, self.mpu.get_sequence_parallel_rank(), group, self.size,
                                             torch.device("cpu"))
        micro = next(adapter)
        return micro, micro.pop("shift_labels")

    def loss(self, model: nn.Module, inputs: dict, labels: torch.Tensor, tiled: bool) -> torch.Tensor:
        if tiled:
            loss = _tiled_loss(model, inputs, labels, self.tiles_for)
        else:
            logits = model(**inputs, use_cache=False).logits
            loss = model.loss_function(logits=logits, labels=None, shift_labels=labels, vocab_size=logits.shape[-1])
        return loss if self.mpu is None else self._sp_mean(loss, labels)

    def _sp_mean(self, loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The HF Trainer's SP loss: per-rank means weighted by per-rank real-token counts."""
        import torch.distributed.nn.functional as dnn

        group = self.mpu.get_sequence_parallel_group()
        good = (labels != IGNORE).sum()
        losses = dnn.all_gather(loss, group=group)
        counts = dnn.all_gather(good, group=group)
        total = sum(losses[r] * counts[r] for r in range(self.size) if counts[r] > 0)
        return total / max(sum(counts), 1)


def _tile_mlp(mlp: nn.Module, tiles_for: Callable[[int], int]) -> None:
    """ALST's recipe: the MLP's forward through ``TiledMLP`` (the docstring's monkey patch, per module)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    plain = type(mlp).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        params = [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight]
        return TiledMLP.apply(plain, mlp, x, tiles_for(x.shape[-2]), params)

    mlp.forward = forward


def _ce_sum(head: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = head(x).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")


def _tiled_loss(model: nn.Module, inputs: dict, labels: torch.Tensor, tiles_for: Callable[[int], int]) -> torch.Tensor:
    """The shard's mean loss, the LM head + loss through ``TiledFusedLogitsLoss`` (sum, then / tokens)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    head = model.lm_head
    shards = tiles_for(hidden.shape[1])
    loss_sum = TiledFusedLogitsLoss.apply(_ce_sum, head, hidden, labels, None, shards, [head.weight], "sum")
    return loss_sum / (labels != IGNORE).sum().clamp_min(1)
