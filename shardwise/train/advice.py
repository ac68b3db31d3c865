"""What a run says when its numbers mean something a newcomer would miss.

A small corpus trained for many steps is memorised: the training loss keeps falling while the
held-out loss climbs (400 steps of 16 sequences over 6 KB of text is ~150 passes and ends at a
held-out perplexity in the thousands). The run says so at the start, from the counts, and at the
end, from its eval history, naming the fix, instead of ending on a bad number silently.
"""

from __future__ import annotations

from typing import Any

MANY_PASSES = 30  # passes over the training sequences past which a small model memorises them
RISE = 1.10  # a final held-out loss this much above the best one is a rise, not noise


def passes_note(steps: int, global_batch: int, n_train: int) -> str | None:
    """A warning when ``steps`` batches of ``global_batch`` go over the ``n_train`` sequences many times."""
    passes = steps * global_batch / max(n_train, 1)
    if passes <= MANY_PASSES:
        return None
    fit = max(1, int(MANY_PASSES * n_train / global_batch))
    return (f"note: {steps} steps x {global_batch} sequences is {passes:.0f} passes over the {n_train} training "
            f"sequences; the model will likely memorise them and its held-out loss rise. Give more --data, or "
            f"--steps {fit} or fewer")


def eval_rise_note(evals: list[dict[str, Any]]) -> str | None:
    """A note when the last held-out loss is clearly above the best one seen in ``evals`` (metrics rows)."""
    if len(evals) < 2:
        return None
    best = min(evals, key=lambda r: r["eval_loss"])
    last = evals[-1]
    if last["eval_loss"] <= best["eval_loss"] * RISE:
        return None
    return (f"note: the held-out loss rose from {best['eval_loss']:.3f} at step {best['step']} to "
            f"{last['eval_loss']:.3f}: the model memorised the training data. Fewer --steps (about "
            f"{best['step']}) or more --data would end better")
