"""Equivalence tolerances derived from a measured noise floor, so the suite holds on any x86 CPU.

A sharded run and the single-process reference agree in exact arithmetic; in fp32 they differ by
round-off whose size depends on the CPU's kernels (AVX2 vs AVX-512 GEMM blocking, the
ATEN_CPU_CAPABILITY torch picked). A fixed bound tuned on one machine fails on another (an AMD EPYC
saw 7e-5 against 1e-5). So each equivalence test also trains the reference a second time with
another micro-batch split (other GEMM shapes and summation order), measures how far the two
references differ, and bounds the sharded run by K times that, never below a floor of a few ulps
per step. A real bug (a missing gradient, a wrong shard) moves weights by O(lr) = 1e-3 relative,
far above any bound this gives; ``NOISE_MAX`` refuses a reference so noisy that the bound would
stop meaning anything.
"""

from __future__ import annotations

K = 10  # sharding changes more orders than one re-split; measured ratios are in docs/reliability.md
ULPS_PER_STEP = 32  # the floor: 32 fp32 ulps (relative) per optimizer step (1.1e-5 for 3 steps)
EPS32 = 2.0 ** -23
NOISE_MAX = 1e-3  # a reference noisier than this is itself broken: fail rather than widen


def equivalence_tol(noise: dict[str, float], steps: int) -> dict[str, float]:
    """Bounds for weights and losses: max(K x measured noise, ULPS_PER_STEP ulps x steps)."""
    floor = ULPS_PER_STEP * EPS32 * max(steps, 1)
    for what, value in noise.items():
        assert value < NOISE_MAX, f"the reference's own {what} round-off {value:.3g} exceeds {NOISE_MAX}"
    return {what: max(K * value, floor) for what, value in noise.items()}


def flip_mlp(model) -> None:
    """Reverse the order of every MLP's hidden units, in place (its own inverse).

    The function the model computes is unchanged, but the down projection sums its inputs in the
    reverse order: the same kind of reordering tensor parallelism makes (partial sums over a split
    inner dimension) and that a micro-batch re-split does not (it keeps each dot product's order).
    Adam is elementwise, so training a flipped model and flipping it back is exact in real arithmetic.
    """
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.c_proj.weight", "mlp.c_fc.bias")):
                p.copy_(p.flip(0))
            elif name.endswith(("mlp.down_proj.weight", "mlp.c_fc.weight")):
                p.copy_(p.flip(1))
