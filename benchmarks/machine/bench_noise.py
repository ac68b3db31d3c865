"""The machine's own noise floor: the same fixed work, timed round after round, on every core.

    python benchmarks/machine/bench_noise.py [--rounds 20 --procs 2]

Each round, ``--procs`` processes (one thread each, as a gloo rank runs) do the same fixed torch
work (fp32 matmuls and elementwise ops of a small model's size, ~1.5 s here) and report their time;
the round's figure is the slowest process's. Nothing about shardwise is involved, so the spread of
these rounds (slowest / fastest - 1) is what the machine alone contributes to any step-time spread
measured on it: a mode cannot be shown steadier than this floor.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time


def _work(reps: int, q: mp.Queue) -> None:
    import torch

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    a, w = torch.randn(512, 1024, generator=g), torch.randn(1024, 1024, generator=g)
    t = time.perf_counter()
    for _ in range(reps):
        y = torch.nn.functional.silu(a @ w)
        a = (a + 1e-3 * y[:, :1024]).contiguous()
    q.put(time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--reps", type=int, default=60, help="matmuls per process per round")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    rounds = []
    for _ in range(args.rounds):
        q = ctx.Queue()
        procs = [ctx.Process(target=_work, args=(args.reps, q)) for _ in range(args.procs)]
        for proc in procs:
            proc.start()
        rounds.append(1e3 * max(q.get() for _ in procs))
        for proc in procs:
            proc.join()
    print("ms per round:", " ".join(f"{r:.0f}" for r in rounds))
    spread = max(rounds) / min(rounds) - 1
    print(json.dumps({"median_ms": round(statistics.median(rounds), 1), "spread": round(spread, 3),
                      "rounds": args.rounds, "procs": args.procs}))


if __name__ == "__main__":
    main()
