"""Non-finite values stop `shardwise train` (see docs/train.md, "When training diverges").

After every step all ranks hold the same global loss (the step's all-reduce) and the same gradient
norm (computed over every shard), so they take the same decision without another collective. A
step whose loss or gradient norm is NaN or infinite is *non-finite*; fp16 loss-scale skips are not
(the scaler owns them: the scale goes down and training goes on). The run tolerates
``--max-nonfinite-steps`` such steps (default: the config's ``shardwise.max_nonfinite_steps``, 0),
each skipped by the engine before any weight changes; the next one stops every rank with
:class:`DivergedError`: one line naming the step and the value, exit code 3, nothing of that step
saved. Before every checkpoint and the ``hf/`` export the weights themselves are checked too (an
update with finite gradients can still overflow them), so neither ``latest`` nor ``hf/`` ever
holds a non-finite weight.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.linalg import vector_norm

from shardwise.cli_errors import OneLineError

EXIT_DIVERGED = 3  # not 2: the input was fine, the training diverged (schedulers may tell them apart)


class DivergedError(OneLineError):
    """The run stopped on a non-finite value; the message names the step and the value."""


def nonfinite_values(loss: float, grad_norm: float | None, loss_scaler_skipped: bool) -> str | None:
    """What was non-finite in a step ("loss nan", "gradient norm inf", both), or None.

    ``loss_scaler_skipped``: fp16's dynamic loss scaler skipped the step (an overflow it handles)."""
    if loss_scaler_skipped:
        return None
    parts = [f"loss {loss}"] if not math.isfinite(loss) else []
    if grad_norm is not None and not math.isfinite(grad_norm):
        parts.append(f"gradient norm {grad_norm}")
    return " and ".join(parts) or None


class NonFiniteGuard:
    """Counts non-finite steps over the whole run (the count travels in the checkpoint's client_state)."""

    def __init__(self, allowed: int, count: int = 0) -> None:
        self.allowed, self.count = allowed, count

    def after_step(self, step: int, what: str | None, latest: str | None) -> None:
        """Count a non-finite step; raise :class:`DivergedError` past the allowance."""
        if what is None:
            return
        self.count += 1
        if self.count > self.allowed:
            before = f"{self.count - 1} non-finite step(s) skipped before; " if self.count > 1 else ""
            raise DivergedError(
                f"training diverged at step {step}: {what} (not finite); stopped without saving this step "
                f"({before}--max-nonfinite-steps {self.allowed}). The last checkpoint is {latest or 'none'}: lower "
                "the learning rate and continue with --resume auto, or allow skipped steps with "
                "--max-nonfinite-steps N")

    def check_weights(self, engine, step: int, before: str) -> None:
        """Every rank checks its shard of the weights (finite, and within the compute dtype's range,
        which the export and the next forward cast to); all agree through one all-reduce."""
        top = torch.finfo(engine.compute_dtype).max if engine.compute_dtype.is_floating_point else math.inf
        bad = 0.0
        for group in engine.optimizer.param_groups if engine.optimizer is not None else []:
            for p in group["params"]:
                if p.numel() and p.device.type != "meta" and not vector_norm(p.detach(), ord=math.inf) <= top:
                    bad = 1.0  # the largest magnitude (no copy of the tensor); NaN fails the comparison too
                    break
        flag = torch.tensor([bad], dtype=torch.float64, device=engine.device)
        dist.all_reduce(flag)
        if flag.item() > 0:
            raise DivergedError(
                f"training diverged at step {step}: the weights hold non-finite values (or values beyond "
                f"{engine.compute_dtype}'s range) although the loss and gradient norm were finite: the update "
                f"overflowed (too high a learning rate?); stopped before {before}, nothing of this step saved")
