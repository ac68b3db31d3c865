"""Hold the planner's alpha-beta model against collectives measured on this machine (gloo, loopback).

    python benchmarks/machine/bench_planner.py [--nproc 2 4] [--reps 5]

Per world size: alpha and beta are calibrated from one *ring shift* (every rank sends a chunk to
the next and receives one from the previous, all at once: exactly one step of a ring) at 4 KiB and
16 MiB, and gamma (the speed of the reductions' additions) from adding two 16 MiB tensors. The
model then predicts shardwise's ring all-gather and reduce-scatter and gloo's all-reduce at 4, 16
and 64 MiB; the table prints predicted, measured (median over reps, slowest rank) and their ratio.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MiB = 2**20


def _median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    worst = torch.tensor([statistics.median(times)])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank does
    return float(worst)


def _shift_s(nbytes: int, reps: int) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    send, recv = torch.ones(nbytes // 4), torch.empty(nbytes // 4)

    def step() -> None:
        reqs = [dist.isend(send, (rank + 1) % world), dist.irecv(recv, (rank - 1) % world)]
        for r in reqs:
            r.wait()
    return _median_s(step, reps)


def _worker(rank: int, world: int, port: int, reps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from shardwise.comm import Comm
    from shardwise.estimate.planner import ring_seconds

    comm = Comm()
    small, large = 4 * 1024, 16 * MiB
    t_small, t_large = _shift_s(small, 5 * reps), _shift_s(large, reps)
    beta = (large - small) / (t_large - t_small)
    alpha = max(t_small - small / beta, 0.0)
    a, b = torch.randn(large // 4), torch.randn(large // 4)
    gamma = large / _median_s(lambda: a.add_(b), reps)  # bytes/s of the reductions' additions
    rows = []
    for mib in (4, 16, 64):
        full = torch.randn(mib * MiB // 4 // world * world)
        out = torch.empty(full.numel() // world)
        for kind, fn in (("all_gather", lambda f=full: comm.all_gather(f)),
                         ("reduce_scatter", lambda f=full, o=out: comm.reduce_scatter(f, o)),
                         ("all_reduce", lambda f=full: comm.all_reduce(f))):
            measured = _median_s(fn, reps)
            predicted = ring_seconds(kind, full.numel() * 4, world, beta, alpha, gamma)
            rows.append((world, kind, mib, predicted, measured))
    if rank == 0:
        queue.put((world, alpha, beta, gamma, rows))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    print("| ranks | collective | MiB | predicted ms | measured ms | measured / predicted |")
    print("|---|---|---|---|---|---|")
    for world in args.nproc:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = ctx.Queue()
        mp.start_processes(_worker, args=(world, port, args.reps, queue), nprocs=world, start_method="spawn")
        world, alpha, beta, gamma, rows = queue.get()
        for w, kind, mib, pred, meas in rows:
            print(f"| {w} | {kind} | {mib} | {pred * 1e3:.1f} | {meas * 1e3:.1f} | {meas / pred:.2f} |")
        print(f"| {world} | calibration | | alpha {alpha * 1e6:.0f} us | beta {beta / 1e9:.2f} GB/s | "
              f"gamma {gamma / 1e9:.2f} GB/s |")


if __name__ == "__main__":
    main()
