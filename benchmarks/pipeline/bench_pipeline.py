"""The pipeline bubble, measured from timestamps, against (p-1)/(m+p-1) (interleaved: (p-1)/(v*m+p-1)).

Each stage holds layers whose forward sleeps ``--fwd-ms`` and whose backward sleeps twice that (a
stand-in for compute whose time does not depend on how busy the machine's cores are, so the
schedule's idle time is what is measured, not the CPU's contention). Every sleep is timestamped;
a stage's bubble is the part of ``train_batch``'s wall time in which it was not running a layer:
``1 - busy / wall``, averaged over the timed batches, reported for stage 0 (the longest wait).
The peak number of micro-batches whose activations stage 0 held at once is counted too (1F1B keeps
at most ``p``, GPipe all ``m``).

Run on ``p`` ranks (one stage each)::

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/pipeline/bench_pipeline.py --micro 4,8,16
    ... --schedules interleaved_1f1b --virtual 2    # v chunks per rank (PipelineModule(virtual_stages=v))

Prints a markdown table (rank 0) of schedule, p, v, m, measured bubble, (p-1)/(v*m+p-1), peak in flight.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.pipeline import LayerSpec, PipelineModule, bubble_fraction

BUSY: list[float] = []  # seconds this rank spent inside a layer, this batch
FLIGHT = {"now": 0, "peak": 0}  # micro-batches whose activations the first layer holds


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float, first: bool) -> torch.Tensor:  # noqa: ARG004
        ctx.seconds, ctx.first = seconds, first
        start = time.perf_counter()
        time.sleep(seconds)
        BUSY.append(time.perf_counter() - start)
        if first:
            FLIGHT["now"] += 1
            FLIGHT["peak"] = max(FLIGHT["peak"], FLIGHT["now"])
        return x * 1.0

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = time.perf_counter()
        time.sleep(2 * ctx.seconds)
        BUSY.append(time.perf_counter() - start)
        if ctx.first:
            FLIGHT["now"] -= 1
        return grad, None, None


class SleepLayer(nn.Module):
    """A linear layer (so there are gradients to step on) that also sleeps in forward and backward."""

    def __init__(self, width: int, seconds: float, first: bool = False):
        super().__init__()
        self.fc, self.seconds, self.first = nn.Linear(width, width), seconds, first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(self.fc(x), self.seconds, self.first)


def measure(schedule: str, micro: int, args: argparse.Namespace) -> tuple[float, int]:
    """(stage 0's mean bubble over the timed batches, its peak micro-batches in flight)."""
    world = int(os.environ["WORLD_SIZE"])
    seconds = args.fwd_ms / 1000 / args.layers_per_stage
    layers = [LayerSpec(SleepLayer, 16, seconds, i == 0) for i in range(world * args.layers_per_stage)]
    virtual = args.virtual if schedule == "interleaved_1f1b" else 1
    model = PipelineModule(layers, num_stages=world, loss_fn=F.mse_loss, partition_method="uniform",
                           virtual_stages=virtual)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": micro,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "pipeline": {"schedule": schedule}}
    engine, *_ = shardwise.initialize(model=model, config=config)
    data = [(torch.randn(2, 16), torch.randn(2, 16)) for _ in range(micro)]
    bubbles = []
    for step in range(args.warmup + args.batches):
        BUSY.clear()
        FLIGHT.update(now=0, peak=0)
        start = time.perf_counter()
        engine.train_batch(iter(data))
        wall = time.perf_counter() - start
        if step >= args.warmup:
            bubbles.append(1 - sum(BUSY) / wall)
    peak = FLIGHT["peak"]
    return sum(bubbles) / len(bubbles), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro", default="4,8,16", help="micro-batch counts, comma-separated")
    parser.add_argument("--schedules", default="1f1b,gpipe")
    parser.add_argument("--fwd-ms", type=float, default=20.0, help="one stage's forward time per micro-batch")
    parser.add_argument("--layers-per-stage", type=int, default=2, help="layers per rank (at least --virtual)")
    parser.add_argument("--virtual", type=int, default=2, help="chunks per rank under interleaved_1f1b")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    shardwise.init_distributed()
    import torch.distributed as dist

    rows = []
    for schedule in args.schedules.split(","):
        for m in (int(v) for v in args.micro.split(",")):
            bubble, peak = measure(schedule, m, args)
            p, v = dist.get_world_size(), args.virtual if schedule == "interleaved_1f1b" else 1
            rows.append(f"| {schedule} | {p} | {v} | {m} | {bubble:.3f} | {bubble_fraction(p, m, v):.3f} | {peak} |")
    if dist.get_rank() == 0:
        print("| schedule | p | v | m | bubble, stage 0 (measured) | (p-1)/(v*m+p-1) | peak in flight, stage 0 |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
