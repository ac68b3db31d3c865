"""The order in which one stage runs its micro-batches' forwards and backwards.

A schedule is a list of ``("F", i)`` / ``("B", i)`` steps for one stage; the engine runs it, each
forward receiving its input from the stage before (except the first) and sending its output on,
each backward receiving its output's gradient from the stage after (except the last) and sending
its input's gradient back. Backwards (under ``zb_h1`` their weight halves, ``("W", i)``) always run
in micro-batch order, so gradients accumulate in the same order as ``gradient_accumulation_steps``
in one process (the bits do not depend on the schedule or the number of stages).

- ``1f1b`` (the default, DeepSpeed's ``TrainSchedule``): stage ``s`` of ``p`` runs ``p - s - 1``
  forwards, then alternates one forward and one backward, then the remaining backwards. At most
  ``p - s`` micro-batches' activations are held at once, against all ``m`` with GPipe.
- ``gpipe``: every forward, then every backward.

Both leave a stage idle for a fraction ``(p - 1) / (m + p - 1)`` of a step (the bubble).

- ``interleaved_1f1b`` (Megatron-LM's, ``PipelineModule(virtual_stages=v)``): each rank holds ``v``
  chunks of layers (virtual stage ``c * p + s`` is rank ``s``'s chunk ``c``; a micro-batch goes
  round the ranks ``v`` times). Steps are ``("F"|"B", i, c)``; the forwards take the chunks in turns
  of ``p`` micro-batches, warm up ``2 (p - s - 1) + (v - 1) p`` of them, then alternate; each chunk
  still runs its backwards in micro-batch order (the same bits as 1F1B). It needs ``m`` divisible by
  ``p``, and leaves a stage idle for ``(p - 1) / (v m + p - 1)`` of a step.
- ``zb_h1`` (ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241; the order of
  ``torch.distributed.pipelining``'s zero-bubble schedules at one chunk a rank): each backward is split
  into ``("B", i)``, the gradient of the stage's inputs, sent upstream at once, and ``("W", i)``, the
  gradient of its weights (``pipeline/split.py``, ``pipeline/zero_bubble.py``). Stage ``s`` runs 1F1B's
  warm-up, then F and B alternately, adding the oldest micro-batch's W after each B from its ``s``-th
  on; the ``s`` W's still owed end the batch. The W's (where weight gradients accumulate) run in
  micro-batch order, so the bits are 1F1B's. A micro-batch's activations are held from its F to its W:
  at most ``p`` micro-batches on every stage (1F1B: ``p - s`` on stage ``s``, so ``p`` on stage 0;
  the peak is 1F1B's, held on every stage). With times ``F``, ``B``, ``W`` a stage idles
  ``(p - 1)(F + B - W)`` of ``m (F + B + W) + (p - 1)(F + B - W)``: ``(p - 1) / (3 m + p - 1)`` when
  the three are equal (1F1B: ``(p - 1) / (m + p - 1)``).
"""

from __future__ import annotations

from shardwise.engine.compat import UsageError

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zb_h1")


def train_steps(schedule: str, micro_batches: int, stages: int, stage: int, virtual: int = 1) -> list[tuple]:
    """One stage's training steps for one batch under ``schedule``."""
    m = micro_batches
    if schedule == "interleaved_1f1b":
        return interleaved_steps(m, stages, stage, virtual)
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    if schedule == "zb_h1":
        return zero_bubble_steps(m, stages, stage)
    if schedule != "1f1b":
        raise UsageError(f"pipeline schedule {schedule!r} is not served; use one of {', '.join(SCHEDULES)}")
    warmup = min(stages - stage - 1, m)
    steps = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        steps += [("F", warmup + i), ("B", i)]
    steps += [("B", i) for i in range(m - warmup, m)]
    return steps


def zero_bubble_steps(m: int, p: int, s: int) -> list[tuple[str, int]]:
    """ZB-H1 for stage ``s`` of ``p``: 1F1B's warm-up, then F, B and (from the ``s``-th B on) the oldest
    micro-batch's W; the ``s`` W's still owed run last. ``("F" | "B" | "W", micro_batch)``."""
    warmup = min(p - s - 1, m)
    steps = [("F", i) for i in range(warmup)]
    w = 0
    for j in range(m):
        if warmup + j < m:
            steps.append(("F", warmup + j))
        steps.append(("B", j))
        if j >= s:
            steps.append(("W", w))
            w += 1
    return steps + [("W", k) for k in range(w, m)]


def interleaved_steps(m: int, p: int, s: int, v: int) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B for rank ``s`` of ``p`` with ``v`` chunks: ``("F"|"B", micro_batch, chunk)``."""
    if m % p:
        raise UsageError(f"pipeline.schedule interleaved_1f1b needs the micro-batches ({m}, "
                         f"gradient_accumulation_steps) divisible by the {p} stages")
    total = m * v

    def at(k: int, forward: bool) -> tuple[int, int]:
        c = (k % (p * v)) // p
        return (k // (p * v)) * p + k % p, c if forward else v - 1 - c

    warmup = min(2 * (p - s - 1) + (v - 1) * p, total)
    steps = [("F", *at(k, True)) for k in range(warmup)]
    for j in range(total - warmup):
        steps += [("F", *at(warmup + j, True)), ("B", *at(j, False))]
    return steps + [("B", *at(k, False)) for k in range(total - warmup, total)]


def eval_steps(micro_batches: int, virtual: int = 1) -> list[tuple]:
    """Evaluation: forwards only, in order (each micro-batch through every chunk of this rank)."""
    if virtual > 1:
        return [("F", i, c) for i in range(micro_batches) for c in range(virtual)]
    return [("F", i) for i in range(micro_batches)]


def bubble_fraction(stages: int, micro_batches: int, virtual: int = 1, schedule: str = "1f1b") -> float:
    """The idle fraction of a step a schedule leaves on each stage: (p-1) / (v*m + p-1); ``zb_h1`` with
    a forward, an input backward and a weight backward of equal times: (p-1) / (3m + p-1)."""
    if schedule == "zb_h1":
        return (stages - 1) / (3 * micro_batches + stages - 1)
    return (stages - 1) / (virtual * micro_batches + stages - 1)
