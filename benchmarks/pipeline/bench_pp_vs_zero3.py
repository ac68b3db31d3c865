"""Pipeline parallelism's step time against ZeRO-3's on the same ranks, model and global batch.

A small Llama (``benchmarks/shared/models.py``) trained for a few steps on ``WORLD_SIZE`` ranks:

- ``pp``: split into ``WORLD_SIZE`` stages (``pipeline.stages``), one rank a stage, each batch ``--micro``
  micro-batches of ``--rows`` sequences, under each schedule of ``--schedules`` (``1f1b``, ``zb_h1``, ...);
- ``zero3``: the whole model under ZeRO-3 over every rank, each rank ``--micro / WORLD_SIZE``
  micro-batches of ``--rows`` sequences (the same global batch of ``--micro x --rows`` sequences).

Every layout's engine is built first; after ``--warmup`` steps each, the layouts take turns for
``--rounds`` rounds of ``--steps`` steps (so a change in the machine's load falls on all of them), a
round's time being its wall time between barriers over its steps. Rank 0 prints one markdown row per
layout with the median and the range of its rounds' step times, and its first step's loss (the same
model and data: the layouts start from the same loss).

    python -m torch.distributed.run --nproc-per-node 4 benchmarks/pipeline/bench_pp_vs_zero3.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared.models import LR, WD, llama  # noqa: E402

SHAPE = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 8,
         "num_attention_heads": 4, "num_key_value_heads": 4}


def data(step: int, micro: int, rows: int, seq: int) -> list[torch.Tensor]:
    """The step's micro-batches of the global batch (the same tokens under every layout)."""
    g = torch.Generator().manual_seed(step)
    return [torch.randint(0, SHAPE["vocab_size"], (rows, seq), generator=g) for _ in range(micro)]


def config(micro_per_rank: int, rows: int, extra: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": micro_per_rank,
            "gradient_clipping": 0.0, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}, **extra}


def pp_stepper(schedule: str, args: argparse.Namespace):
    world = dist.get_world_size()
    model = llama(SHAPE, seed=0)
    engine, *_ = shardwise.initialize(model=model, config=config(args.micro, args.rows, {
        "pipeline": {"stages": world, "schedule": schedule}}))

    def step(s: int) -> float:
        return float(engine.train_batch(iter([{"input_ids": t} for t in data(s, args.micro, args.rows, args.seq)])))
    step.engine = engine
    return step


def zero3_stepper(args: argparse.Namespace):
    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank = args.micro // world
    model = llama(SHAPE, seed=0)
    engine, *_ = shardwise.initialize(model=model, config=config(per_rank, args.rows, {
        "zero_optimization": {"stage": 3}}))

    def step(s: int) -> float:
        total = 0.0
        for mb in data(s, args.micro, args.rows, args.seq)[rank * per_rank:(rank + 1) * per_rank]:
            loss = engine(input_ids=mb, labels=mb).loss
            engine.backward(loss)
            engine.step()
            total += float(loss.detach()) / per_rank
        mean = torch.tensor([total])
        dist.all_reduce(mean)
        return float(mean) / world
    step.engine = engine
    return step


def moved(step) -> int:
    """The bytes this rank's engine moved so far (``comm_stats()``: every collective, send and receive)."""
    return sum(v for v in step.engine.comm_stats().values() if isinstance(v, int))


def timed(steppers: dict, args: argparse.Namespace) -> dict:
    """Per layout: (its rounds' seconds a step, sorted; its first step's loss; bytes rank 0 moved a step)."""
    first = {name: step(0) for name, step in steppers.items()}
    for step in steppers.values():
        for s in range(1, args.warmup):
            step(s)
    rounds: dict = {name: [] for name in steppers}
    before = {name: moved(step) for name, step in steppers.items()}
    for r in range(args.rounds):
        for name, step in steppers.items():
            dist.barrier()
            start = time.perf_counter()
            for s in range(args.steps):
                step(args.warmup + r * args.steps + s)
            dist.barrier()
            rounds[name].append((time.perf_counter() - start) / args.steps)
    n = args.rounds * args.steps
    return {name: (sorted(rounds[name]), first[name], (moved(step) - before[name]) / n)
            for name, step in steppers.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="1f1b,zb_h1")
    parser.add_argument("--micro", type=int, default=8, help="micro-batches in the global batch")
    parser.add_argument("--rows", type=int, default=2, help="sequences a micro-batch")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2, help="steps a round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    shardwise.init_distributed()
    world = dist.get_world_size()
    steppers = {f"PP {world} ({s}), {args.micro} micro-batches": pp_stepper(s, args) for s in args.schedules.split(",")}
    steppers[f"ZeRO-3 over {world} ranks, {args.micro // world} micro-batches a rank"] = zero3_stepper(args)
    results = timed(steppers, args)
    if dist.get_rank() == 0:
        print(f"| layout ({world} ranks, {args.micro * args.rows} x {args.seq} tokens a step) | step, s (median of "
              f"{args.rounds} rounds) | rounds' range, s | MB rank 0 moved a step | first loss |")
        print("| --- | --- | --- | --- | --- |")
        for name, (secs, loss, nbytes) in results.items():
            print(f"| {name} | {secs[len(secs) // 2]:.3f} | {secs[0]:.3f}-{secs[-1]:.3f} | {nbytes / 1e6:.1f} | "
                  f"{loss:.4f} |")


if __name__ == "__main__":
    main()
