"""torch.compile of a sharded model: step time eager vs compiled, shardwise vs FSDP2 (one command).

    python benchmarks/zero/bench_compile.py                       # 2 ranks, stages 0 and 3, inductor
    python benchmarks/zero/bench_compile.py --stages 3 --backend aot_eager --steps 10

For each mode it launches one gloo job (torchrun, OMP_NUM_THREADS=1 per rank) that trains
``llama-20m`` (``shardwise.cli.train_job``) with fused AdamW and prints the median step time
(forward + backward + step, slowest rank, after warmup; the first compiled steps are warmup) and
the last loss. Modes: ``sw{S}`` / ``sw{S}-compiled`` (``shardwise.shard`` at stage S, then
``shardwise.compile``) and ``fsdp2`` / ``fsdp2-compiled`` (``fully_shard`` per layer and the root,
then ``torch.compile(model)``). The table it prints goes into docs/benchmarks.md ("torch.compile").
Run it on a quiet machine: compiled step times on a busy one say nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}


def _worker(mode: str, args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    import shardwise
    from shardwise.cli.train_job import build_model

    shardwise.init_distributed(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model("llama-20m", args.seq, seed=args.seed)
    compiled = mode.endswith("-compiled")
    if mode.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)
        if compiled:
            model = torch.compile(model, backend=args.backend)
    else:
        stage = int(mode[2])
        model = shardwise.shard(model, stage=stage, bucket_size=50_000_000, overlap_comm=True)
        opt = shardwise.ShardedOptimizer(model, torch.optim.AdamW, fused=True, **ADAMW)
        if compiled:
            shardwise.compile(model, backend=args.backend)
    g = torch.Generator().manual_seed(args.seed + rank)
    times, loss = [], 0.0
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, 256, (args.micro, args.seq), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if step >= args.warmup:
            times.append(float(dt))
    times.sort()
    return {"mode": mode, "world": world, "step_s": times[len(times) // 2], "loss": float(loss)}


def _launch(mode: str, args: argparse.Namespace) -> dict:
    out = REPO / "benchmarks" / "results" / f"compile_{mode}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           __file__, "--worker", mode, "--out", str(out), "--backend", args.backend, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--seq", str(args.seq), "--micro", str(args.micro), "--seed", str(args.seed)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    subprocess.run(cmd, env=env, check=True, timeout=args.job_timeout)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--stages", default="0,3", help="comma list of shardwise stages")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="unmeasured steps first (compilation happens here)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--job-timeout", type=int, default=1800)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        res = _worker(args.worker, args)
        if int(os.environ.get("RANK", 0)) == 0:
            Path(args.out).write_text(json.dumps(res))
        return
    modes = [m for s in args.stages.split(",") for m in (f"sw{s}", f"sw{s}-compiled")] + ["fsdp2", "fsdp2-compiled"]
    rows = [_launch(m, args) for m in modes]
    eager = {r["mode"]: r["step_s"] for r in rows if not r["mode"].endswith("-compiled")}
    print(f"| mode ({args.backend}, {args.nproc} ranks) | step ms | vs its eager | last loss |")
    print("| --- | ---: | ---: | ---: |")
    for r in rows:
        base = eager[r["mode"].removesuffix("-compiled")]
        print(f"| {r['mode']} | {1000 * r['step_s']:.1f} | {base / r['step_s']:.2f}x | {r['loss']:.4f} |")


if __name__ == "__main__":
    main()
