"""The stage >= 2 shard-gradient sum alone: zero + sum into the chunk + add onto the shard (before)
against the sum written straight into the shard (now), interleaved repeats, one thread.

    python benchmarks/zero/bench_shard_sum.py [--numel 10500000 --repeats 15]

10.5M fp32 elements is a 21M-parameter model's shard at 2 ranks (docs/benchmarks.md, issue 23).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=10_500_000)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(1)
    mine, recv, out = (torch.randn(args.numel) for _ in range(3))

    def before() -> None:
        out.zero_()  # zero_grad
        mine.add_(recv)  # rank-order sum into the bucket's chunk
        out.add_(mine)  # accumulated onto the zeroed shard

    def now() -> None:
        torch.add(mine, recv, out=out)  # the sum written straight into the shard

    times: dict[str, list[float]] = {"before": [], "now": []}
    for _ in range(3):
        before(), now()
    for _ in range(args.repeats):
        for name, fn in (("before", before), ("now", now)):
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1e3)
    for name, v in times.items():
        print(f"{name:>6}: median {statistics.median(v):.1f} ms (min {min(v):.1f}, max {max(v):.1f})")


if __name__ == "__main__":
    main()
