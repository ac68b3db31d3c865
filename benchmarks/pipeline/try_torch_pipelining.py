"""Does ``torch.distributed.pipelining`` run on gloo? Its four schedule kinds on 2 CPU ranks.

A 4-layer MLP split over the ranks (2 virtual stages a rank for the interleaved schedules), 4
micro-batches of one batch of 8 rows; each rank prints, per schedule, whether it ran, the losses (last
stage) and the sum of |grad| over its layers; the two ranks' sums together are compared with the
single-process sum of the same micro-batches with the loss scaled by 1/4 (``scale_grads=True``
divides by the micro-batch count)::

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/pipeline/try_torch_pipelining.py

The outcome is recorded in docs/architecture.md ("Pipeline parallelism").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

KINDS = [("gpipe", ScheduleGPipe, 1), ("1f1b", Schedule1F1B, 1), ("interleaved", ScheduleInterleaved1F1B, 2),
         ("zero-bubble", ScheduleInterleavedZeroBubble, 2)]


def run(full: nn.Sequential, cls: type, virtual: int, x: torch.Tensor, y: torch.Tensor) -> tuple:
    rank, world = dist.get_rank(), dist.get_world_size()
    n = world * virtual
    per = len(full) // n
    stages = [PipelineStage(nn.Sequential(*full[i * per:(i + 1) * per]), i, n, torch.device("cpu"))
              for i in (rank + k * world for k in range(virtual))]
    full.zero_grad()
    sched = cls(stages[0] if virtual == 1 else stages, n_microbatches=4, loss_fn=F.mse_loss)
    losses: list = []
    if rank == 0:
        sched.step(x)
    else:
        sched.step(target=y, losses=losses)
    grad = sum(float(p.grad.abs().sum()) for s in stages for p in s.submod.parameters())
    return [float(v) for v in losses], grad


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    full = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for name, cls, virtual in KINDS:
        try:
            losses, grad = run(full, cls, virtual, x, y)
            print(f"rank {dist.get_rank()} {name}: ran; losses {losses}; sum |grad| here {grad:.7f}")
        except Exception as e:  # noqa: BLE001 - the outcome is what is printed
            print(f"rank {dist.get_rank()} {name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    full.zero_grad()
    for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True):
        (F.mse_loss(full(xs), ys) / 4).backward()
    if dist.get_rank() == 0:
        print(f"one process: sum |grad| {sum(float(p.grad.abs().sum()) for p in full.parameters()):.7f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
