"""A timeline of one NVMe-offload step: when each sub-group is read, stepped and written, and on which thread.

    python benchmarks/offload/nvme_pipeline_timeline.py --nvme-path /mnt/nvme [--buffers 4] [--compute 0.05]

``--pieces`` groups of ``--numel`` fp32 elements (SGD, no state) are swapped by an ``OptimizerSwapper``
with ``pipeline_read`` and ``pipeline_write``; the optimizer's step is made to last ``--compute`` seconds
more by a sleep, which holds neither a core nor the GIL, so the timeline shows what overlaps what without
the machine's load in the way: in a pipelined step sub-group ``u`` steps while ``u - 1`` is written and
``u + 1, ...`` are read. Prints one line per event (seconds since the step began, thread, event).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from types import SimpleNamespace

import torch

from shardwise.nvme import NvmeSettings, OptimizerSwapper


def _group(numel: int, seed: int) -> SimpleNamespace:
    """What the swapper reads of a stage-2 group: its master, its reduced gradient, where the step goes."""
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return SimpleNamespace(master=torch.zeros(numel), own_numel=numel, device=torch.device("cpu"), replicate=None,
                           policy=SimpleNamespace(shard_params=False), owned_grad=lambda: grad,
                           wait=lambda: None, wait_gathered=lambda: None, release_grad_shard=lambda: None,
                           publish_master=lambda async_op, copied=False: None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvme-path", required=True)
    p.add_argument("--pieces", type=int, default=6)
    p.add_argument("--numel", type=int, default=4_000_000)
    p.add_argument("--buffers", type=int, default=4)
    p.add_argument("--compute", type=float, default=0.05, help="seconds added to each sub-group's step")
    args = p.parse_args()
    groups = [_group(args.numel, i) for i in range(args.pieces)]
    opt = torch.optim.SGD([g.master for g in groups], lr=0.1)
    t0, events = [0.0], []

    def log(what: str) -> None:
        events.append((time.perf_counter() - t0[0], threading.current_thread().name, what))

    step = opt.step

    def slow_step(*a, **k):
        log("step start")
        time.sleep(args.compute)
        out = step(*a, **k)
        log("step end")
        return out

    opt.step = slow_step
    settings = NvmeSettings(nvme_path=tempfile.mkdtemp(dir=args.nvme_path), buffer_count=args.buffers,
                            pipeline_read=True, pipeline_write=True)
    swapper = OptimizerSwapper(groups, opt, settings, rank=0)
    read, write = swapper._read, swapper._write  # noqa: SLF001 - the probe wraps the swapper's own transfers

    def timed(kind, f):
        def run(u, buf):
            log(f"{kind} {u} start")
            f(u, buf)
            log(f"{kind} {u} end")
        return run

    swapper._read, swapper._write = timed("read", read), timed("write", write)  # noqa: SLF001
    sharding = SimpleNamespace(groups=groups, wait_for_params=lambda: None, grad_norm=lambda sq, squared: 1.0)
    try:
        swapper.grad_norm(sharding, 1.0)
        swapper.drop_prefetched()
        t0[0] = time.perf_counter()
        swapper.step_and_publish(sharding)
        log("step_and_publish returned")
        swapper.drop_prefetched()
    finally:
        swapper.close()
    for t, thread, what in events:
        print(f"{t:7.3f} {thread[-14:]:>14} {what}")


if __name__ == "__main__":
    main()
