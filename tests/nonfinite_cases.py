"""Rank-side cases for test_run_guard.py: the engine's rule for a non-finite gradient norm (fp32).

A NaN enters the loss of rank 1 only: the norm is computed over every shard, so both ranks see it
and take the same decision. With ``shardwise.max_nonfinite_steps`` N the first N such steps are
skipped (weights and optimizer untouched); the next raises ``NonFiniteError`` naming its step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from ds_api_cases import config, data, mine, model

import shardwise
from shardwise.engine import NonFiniteError
from shardwise.utils import safe_get_full_fp32_param


def _weights(engine) -> list[torch.Tensor]:
    return [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]


def skip_then_raise(stage: int, allowed: int) -> dict:
    """Step 1 clean, then NaN on rank 1 at every step until the engine raises; what each step did."""
    engine, *_ = shardwise.initialize(model=model(), config={**config(stage),
                                                             "shardwise": {"max_nonfinite_steps": allowed}})
    xs, ys = data(4)
    seen: list = []
    for s in range(4):
        before = _weights(engine)
        loss = engine(mine(xs[s]), mine(ys[s]))
        if s > 0 and dist.get_rank() == 1:
            loss = loss * float("nan")
        engine.backward(loss)
        try:
            engine.step()
        except NonFiniteError as e:
            seen.append({"raised_at": e.step, "what": e.what})
            break
        same = all(torch.equal(a, b) for a, b in zip(before, _weights(engine), strict=True))
        seen.append({"applied": engine.was_step_applied(), "weights_unchanged": same})
    return {"seen": seen, "skipped": engine.skipped_steps, "nonfinite": engine.nonfinite_steps}
