"""The pipeline bubble, measured from timestamps, and the activations each stage holds, per schedule.

Each stage holds layers whose forward sleeps ``--fwd-ms`` and whose backward sleeps twice that: half in
the part that gives the layer's input its gradient (B) and half in the part that gives its weight its
gradient (W), a stand-in for compute whose time does not depend on how busy the machine's cores are, so
the schedule's idle time is what is measured, not the CPU's contention. 1F1B, GPipe and interleaved 1F1B
run B and W as one backward; ``zb_h1`` runs W later, in the bubble. Every sleep is timestamped; a stage's
bubble is the part of ``train_batch``'s wall time in which it was not running a layer: ``1 - busy /
wall``, averaged over the timed batches, reported for stage 0 (the longest wait). Formulas: (p-1)/(v*m+p-1)
(GPipe, 1F1B: v = 1), (p-1)/(3m+p-1) for zb_h1 with F = B = W.

Activation memory: every tensor autograd saves for backward (``saved_tensors_hooks``; the parameters'
own storage excluded) is counted while it is alive, so the peak bytes a stage holds during a batch is
measured, and divided by one micro-batch's saved bytes it gives the peak micro-batches held (1F1B: p - s
on stage s; GPipe: m; zb_h1: p on every stage, as it keeps a micro-batch's graph from its B to its W).

Run on ``p`` ranks (one stage each)::

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/pipeline/bench_pipeline.py --micro 4,8,16
    ... --schedules interleaved_1f1b --virtual 2    # v chunks per rank (PipelineModule(virtual_stages=v))

Prints a markdown table (rank 0) of schedule, p, v, m, measured bubble, its formula, and per stage the
peak saved-activation bytes and micro-batches held.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.pipeline import LayerSpec, PipelineModule, bubble_fraction

BUSY: list[float] = []  # seconds this rank spent inside a layer, this batch


class _Sleep(torch.autograd.Function):
    """Sleeps ``seconds`` in forward and in backward (the input's gradient: B)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        _nap(seconds)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _nap(ctx.seconds)
        return grad, None


class _SleepOnWeightGrad(torch.autograd.Function):
    """The weight itself forward; sleeps ``seconds`` in its gradient (W)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return w.view_as(w)  # the weight's own storage: not counted as an activation

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _nap(ctx.seconds)
        return grad, None


def _nap(seconds: float) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    BUSY.append(time.perf_counter() - start)


class SleepLayer(nn.Module):
    """A linear layer (so there are gradients to step on) that also sleeps in forward, B and W."""

    def __init__(self, width: int, seconds: float):
        super().__init__()
        self.fc, self.seconds = nn.Linear(width, width), seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _SleepOnWeightGrad.apply(self.fc.weight, self.seconds)
        return _Sleep.apply(F.linear(x, w, self.fc.bias), self.seconds)


class _Saved:
    """One saved tensor, counted in ``Held`` while autograd keeps it."""

    def __init__(self, t: torch.Tensor, held: Held, nbytes: int):
        self.t, self.held, self.nbytes = t, held, nbytes
        held.add(nbytes)

    def __del__(self) -> None:
        self.held.add(-self.nbytes)


class Held:
    """The bytes the stage's forwards saved for backward alive now, their peak and their total over a batch
    (what a backward saves, e.g. the engine's ``sum(output * gradient)``, is not an activation: not counted)."""

    def __init__(self, model: nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.now = self.peak = self.total = 0
        self.forward = False
        model.register_forward_pre_hook(lambda *_: setattr(self, "forward", True))
        model.register_forward_hook(lambda *_: setattr(self, "forward", False))

    def reset(self) -> None:
        self.peak, self.total = self.now, 0

    def add(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)
        self.total += max(n, 0)

    def pack(self, t: torch.Tensor):
        if not self.forward or t.untyped_storage().data_ptr() in self.params:  # a weight (or a view of one)
            return t
        return _Saved(t, self, t.numel() * t.element_size())

    @staticmethod
    def unpack(packed):
        return packed.t if isinstance(packed, _Saved) else packed


def measure(schedule: str, micro: int, args: argparse.Namespace) -> tuple[float, int, float]:
    """(stage 0's mean bubble over the timed batches, this stage's peak saved-activation bytes, and that peak in
    micro-batches: over one micro-batch's saved bytes)."""
    world = int(os.environ["WORLD_SIZE"])
    seconds = args.fwd_ms / 1000 / args.layers_per_stage
    layers = [LayerSpec(SleepLayer, args.width, seconds) for _ in range(world * args.layers_per_stage)]
    virtual = args.virtual if schedule == "interleaved_1f1b" else 1
    model = PipelineModule(layers, num_stages=world, loss_fn=F.mse_loss, partition_method="uniform",
                           virtual_stages=virtual)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": micro,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "pipeline": {"schedule": schedule}}
    engine, *_ = shardwise.initialize(model=model, config=config)
    data = [(torch.randn(2, args.width), torch.randn(2, args.width)) for _ in range(micro)]
    bubbles, peaks = [], []
    held = Held(model)
    for step in range(args.warmup + args.batches):
        BUSY.clear()
        held.reset()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(held.pack, held.unpack):
            engine.train_batch(iter(data))
        wall = time.perf_counter() - start
        if step >= args.warmup:
            bubbles.append(1 - sum(BUSY) / wall)
            peaks.append((held.peak, held.peak * micro / max(held.total, 1)))
    return sum(bubbles) / len(bubbles), max(p for p, _ in peaks), max(m for _, m in peaks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro", default="4,8,16", help="micro-batch counts, comma-separated")
    parser.add_argument("--schedules", default="1f1b,gpipe,zb_h1")
    parser.add_argument("--fwd-ms", type=float, default=20.0, help="one stage's forward time per micro-batch")
    parser.add_argument("--layers-per-stage", type=int, default=2, help="layers per rank (at least --virtual)")
    parser.add_argument("--virtual", type=int, default=2, help="chunks per rank under interleaved_1f1b")
    parser.add_argument("--width", type=int, default=64, help="each layer's width (2 rows a micro-batch)")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    shardwise.init_distributed()
    rows, p = [], dist.get_world_size()
    for schedule in args.schedules.split(","):
        for m in (int(v) for v in args.micro.split(",")):
            bubble, peak, in_micro = measure(schedule, m, args)
            stages = [None] * p
            dist.all_gather_object(stages, (peak, in_micro))
            v = args.virtual if schedule == "interleaved_1f1b" else 1
            formula = bubble_fraction(p, m, v, schedule=schedule)
            held = " / ".join(f"{b / 1024:.1f} KiB ({k:.1f})" for b, k in stages)
            rows.append(f"| {schedule} | {p} | {v} | {m} | {bubble:.3f} | {formula:.3f} | {held} |")
    if dist.get_rank() == 0:
        print("| schedule | p | v | m | bubble, stage 0 (measured) | formula | peak saved activations by stage "
              "(micro-batches) |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
