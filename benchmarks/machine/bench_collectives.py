"""gloo collectives on this machine: native all-reduce / all-gather / reduce-scatter vs shardwise's rings.

    python benchmarks/machine/bench_collectives.py [--nproc 2] [--mib 64]

The numbers behind `shardwise.comm`'s choice of point-to-point rings on gloo (docs/architecture.md).
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


def _worker(rank: int, world: int, port: int, mib: int, reps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from shardwise.comm import Comm

    comm = Comm()
    full = torch.randn(mib * 2**20 // 4 // world * world)
    shard = full.numel() // world
    out = torch.empty(shard)
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    cases = {
        "all_reduce (gloo)": lambda: dist.all_reduce(full),
        "all_gather (gloo)": lambda: ag(full, full[rank * shard:(rank + 1) * shard].clone()),
        "reduce_scatter (gloo)": lambda: rs(out, full),
        "all_gather (shardwise ring)": lambda: comm.all_gather(full),
        "reduce_scatter (shardwise ring)": lambda: comm.reduce_scatter(full, out),
    }
    for name, fn in cases.items():
        fn()
        times = []
        for _ in range(reps):
            dist.barrier()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        if rank == 0:
            print(f"{name:<34} {statistics.median(times) * 1e3:8.1f} ms", flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--mib", type=int, default=64, help="size of the full fp32 buffer")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"{args.nproc} gloo ranks, full buffer {args.mib} MiB fp32, median of {args.reps}")
    mp.spawn(_worker, args=(args.nproc, port, args.mib, args.reps), nprocs=args.nproc)


if __name__ == "__main__":
    main()
