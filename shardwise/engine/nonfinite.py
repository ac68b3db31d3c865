"""What the engine does with a non-finite gradient norm when no fp16 loss scaler owns it.

In fp16 a non-finite norm is the loss scaler's business: the step is skipped and the scale lowered
(not divergence). In fp32 and bf16 nothing can make the step good, so by default it stops training:
:class:`NonFiniteError` (a ``FloatingPointError``) naming the optimizer step, before the optimizer
touches any weight. ``shardwise.max_nonfinite_steps`` (config key; ``engine.max_nonfinite_steps``)
lets that many such steps be skipped instead, in the engine's lifetime, as fp16 skips are: no
optimizer or scheduler step, gradients dropped, ``was_step_applied()`` False, ``skipped_steps``
counted. The next one past the allowance raises.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from shardwise.engine.parts import EngineParts

log = logging.getLogger("shardwise")


class NonFiniteError(FloatingPointError):
    """Training diverged: a gradient norm (or, in ``shardwise train``, a loss or weight) is not finite.

    ``step`` is the 1-based optimizer step it happened in; ``what`` names the value, ``value`` is it."""

    def __init__(self, message: str, step: int, what: str, value: float) -> None:
        super().__init__(message)
        self.step, self.what, self.value = step, what, value


def skip_nonfinite_step(engine: EngineParts, norm: float) -> bool:
    """True (skip the step) while within ``engine.max_nonfinite_steps``; past it, raise."""
    step = engine.global_steps + 1
    engine.nonfinite_steps += 1
    allowed = engine.max_nonfinite_steps
    if engine.nonfinite_steps > allowed:
        raise NonFiniteError(f"gradient norm is {norm} at optimizer step {step}: the loss diverged (no fp16 loss "
                             f"scaler to skip the step; {engine.nonfinite_steps - 1} non-finite step(s) skipped "
                             f"before, shardwise.max_nonfinite_steps = {allowed})", step, "gradient norm", norm)
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.warning(f"gradient norm is {norm} at optimizer step {step}: step skipped ({engine.nonfinite_steps} of "
                    f"shardwise.max_nonfinite_steps = {allowed})")
    return True
