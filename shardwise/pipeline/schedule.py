"""The order in which one stage runs its micro-batches' forwards and backwards.

A schedule is a list of ``("F", i)`` / ``("B", i)`` steps for one stage; the engine runs it, each
forward receiving its input from the stage before (except the first) and sending its output on,
each backward receiving its output's gradient from the stage after (except the last) and sending
its input's gradient back. Backwards always run in micro-batch order, so gradients accumulate in
the same order as ``gradient_accumulation_steps`` in one process (the bits do not depend on the
schedule or the number of stages).

- ``1f1b`` (the default, DeepSpeed's ``TrainSchedule``): stage ``s`` of ``p`` runs ``p - s - 1``
  forwards, then alternates one forward and one backward, then the remaining backwards. At most
  ``p - s`` micro-batches' activations are held at once, against all ``m`` with GPipe.
- ``gpipe``: every forward, then every backward.

Both leave a stage idle for a fraction ``(p - 1) / (m + p - 1)`` of a step (the bubble).
"""

from __future__ import annotations

from shardwise.engine.compat import UsageError

SCHEDULES = ("1f1b", "gpipe")


def train_steps(schedule: str, micro_batches: int, stages: int, stage: int) -> list[tuple[str, int]]:
    """One stage's training steps for one batch under ``schedule``."""
    m = micro_batches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule != "1f1b":
        raise UsageError(f"pipeline schedule {schedule!r} is not served; use one of {', '.join(SCHEDULES)}")
    warmup = min(stages - stage - 1, m)
    steps = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        steps += [("F", warmup + i), ("B", i)]
    steps += [("B", i) for i in range(m - warmup, m)]
    return steps


def eval_steps(micro_batches: int) -> list[tuple[str, int]]:
    """Evaluation: forwards only, in order."""
    return [("F", i) for i in range(micro_batches)]


def bubble_fraction(stages: int, micro_batches: int, virtual: int = 1) -> float:
    """The idle fraction of a step a schedule leaves on each stage: (p-1) / (v*m + p-1)."""
    return (stages - 1) / (virtual * micro_batches + stages - 1)
