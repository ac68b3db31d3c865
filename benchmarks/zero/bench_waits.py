"""Where a step waits: time each rank spends blocked in shardwise's collective waits, by phase.

    python benchmarks/zero/bench_waits.py [--modes sw3,sw1 --size 90m --steps 5 --warmup 2]

Runs ``bench_zero_worker.py``'s training loop (the scaling table's model and config) as a 2-rank
gloo job per mode, with :class:`shardwise.comm.Work`'s ``wait`` and the stage >= 2 in-flight bound
(``InflightLimit.admit``, which waits for the oldest pending reduce-scatter) timed, and prints, per
rank, the milliseconds a step spends blocked in each, split into backward (inside the autograd
engine) and the rest (forward and ``step()``). The ``admit`` figure contains the reduce-scatter
waits it makes (they are also counted under ``wait reduce_scatter``). On gloo a collective is CPU work on the cores that
also compute, so these waits are where a mode's extra bytes show in its step time
(``docs/benchmarks.md``, stop 30: why ZeRO-3 stays above DDP on 2 cores).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _rank_job(argv: list[str]) -> None:
    """One rank: the benchmark worker with the waits timed (this file, run by torchrun through
    ``bench_zero.run_mode``); the waits go to ``<out>.waits<rank>.json`` beside the worker's results."""
    import bench_zero_worker as worker
    import torch

    src = os.environ.pop("BENCH_SHARDWISE_SRC", None)  # the package run_mode benchmarks: patch that one
    if src:
        worker.import_shardwise_from(src)
    from shardwise.comm import core
    from shardwise.zero import pending

    spent: dict[str, float] = collections.defaultdict(float)

    def phase() -> str:
        return "backward" if torch._C._current_graph_task_id() != -1 else "forward+step"

    def timed(fn, label):
        def wrapper(self, *a):
            t = time.perf_counter()
            fn(self, *a)
            spent[f"{phase()} {label(self)}"] += time.perf_counter() - t
        return wrapper

    core.Work.wait = timed(core.Work.wait, lambda w: f"wait {w._kind}")
    pending.InflightLimit.admit = timed(pending.InflightLimit.admit, lambda _: "admit (bucket bound)")
    args = worker.parse_args(argv)
    steps = args.steps + args.warmup + 1  # the worker's extra untimed step included
    worker.worker(args)
    rank = int(os.environ.get("RANK", 0))
    Path(f"{args.out}.waits{rank}.json").write_text(
        json.dumps({k: round(1e3 * v / steps, 1) for k, v in sorted(spent.items())}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="sw3,sw1", help="bench_zero.py modes of shardwise (comma list)")
    p.add_argument("--size", default="90m", help="a bench_scaling.py size: 21m, 90m, 300m")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    import bench_zero
    from bench_scaling import model_spec

    work = Path(tempfile.mkdtemp(prefix="bench_waits_"))
    job = bench_zero.parser().parse_args(["--steps", str(args.steps), "--warmup", str(args.warmup),
                                          "--model", model_spec(args.size, work)])
    for mode in args.modes.split(","):
        res = bench_zero.run_mode(mode, job, work, worker=Path(__file__))
        if "error" in res:
            sys.exit(f"{mode}: the job failed: {res['error']}")
        print(f"{mode} at {args.size}: {res['step_ms_median']:.0f} ms a step (forward {res['fwd_ms']:.0f}, "
              f"backward {res['bwd_ms']:.0f}, step {res['opt_ms']:.0f}); blocked, ms a step:")
        for rank in range(job.nproc):
            waits = json.loads(Path(f"{work / mode}.json.waits{rank}.json").read_text())
            print(f"  rank {rank}: " + ", ".join(f"{k} {v}" for k, v in waits.items()))


if __name__ == "__main__":
    if "--mode" in sys.argv:  # a rank of a job (bench_zero.run_mode passes --mode; this CLI takes --modes)
        _rank_job(sys.argv[1:])
    else:
        main()
