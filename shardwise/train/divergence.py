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

What the run reports is watched as well, because finite weights can still compute non-finite
outputs (weights near 1e6 after an lr typo overflow a softmax): a non-finite eval loss stops the run
before the step's checkpoint and before the export; a non-finite logit while sampling stops it and
removes the ``hf/`` export just written (the model that made it is diverged). A gradient norm of
exactly 0.0 (every parameter's gradient zero: a dead model, e.g. saturated by a huge update) is not
divergence but is reported once, as a warning naming the step.
"""

from __future__ import annotations

import math

import torch
from torch.linalg import vector_norm

from shardwise.comm import make_comm
from shardwise.errors import OneLineError

EXIT_DIVERGED = 3  # not 2: the input was fine, the training diverged (schedulers may tell them apart)
EXIT_RANK_FAILED = 4  # one rank failed (a collective broke, a peer died or stalled, memory ran out): restart


class RankOutOfMemoryError(OneLineError):
    """This rank ran out of device memory in one phase of a step; the message names the rank and phase."""


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
        self.warned_dead = False

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

    def check_eval(self, step: int, loss: float, latest: str | None) -> None:
        """A non-finite eval loss (every rank holds the same one, after its all-reduce) stops the run."""
        if not math.isfinite(loss):
            raise DivergedError(
                f"training diverged at step {step}: eval loss {loss} (not finite) although the training loss "
                f"and gradient norm were finite; stopped without saving this step or exporting. The last "
                f"checkpoint is {latest or 'none'}: lower the learning rate and continue with --resume auto")

    def check_probe(self, step: int, loss: float, before: str) -> None:
        """The probe forward's loss (``loop.probe_loss``, before a checkpoint or the export) must be finite."""
        if not math.isfinite(loss):
            raise DivergedError(
                f"training diverged at step {step}: the model's loss on a training sequence is {loss} (not finite) "
                f"although the training loss, gradient norm and weights were finite; stopped before {before}, "
                "nothing of this step saved. Lower the learning rate and continue with --resume auto")

    def dead_model_note(self, step: int, grad_norm: float | None) -> str | None:
        """A warning, the first time only, when the global gradient norm is exactly zero."""
        if grad_norm != 0.0 or self.warned_dead:
            return None
        self.warned_dead = True
        return (f"warning: at step {step} the gradient norm is exactly 0.0 (every parameter's gradient is zero): "
                "the model no longer learns (saturated by too high a learning rate?); reported once")

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
        make_comm().all_reduce(flag)
        if flag.item() > 0:
            raise DivergedError(
                f"training diverged at step {step}: the weights hold non-finite values (or values beyond "
                f"{engine.compute_dtype}'s range) although the loss and gradient norm were finite: the update "
                f"overflowed (too high a learning rate?); stopped before {before}, nothing of this step saved")


class FiniteLogits:
    """A ``generate()`` logits processor that stops sampling at the first NaN or +inf logit, or a row
    with no finite logit at all (-inf alone is a masked token, which processors before it may set).

    Every rank holds the same logits (same weights, same seed), so all raise alike."""

    def __init__(self, step: int) -> None:
        self.step = step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        bad = scores.isnan().any() | scores.isposinf().any() | ~scores.isfinite().any(dim=-1).all()
        if bool(bad):
            raise DivergedError(
                f"training diverged at step {self.step}: the sampled logits are not finite (after "
                f"{input_ids.shape[-1]} tokens) although the training loss was finite; the hf/ export of this "
                "model was removed. Lower the learning rate and continue with --resume auto")
        return scores
