"""The optimizer phase of optimizer offload alone: torch's fused CPU AdamW against DeepSpeedCPUAdam.

    python benchmarks/bench_offload.py                       # sizes 10M,45M,150M fp32 elements, 7 rounds
    python benchmarks/bench_offload.py --numel 45e6 --rounds 9 --threads 1

What ``offload_optimizer`` steps on a rank is one flat fp32 shard per bucket with its gradient
(Ψ/N elements: 10M, 45M and 150M are the 21M, 90M and 300M models' shards at 2 ranks). Each
round steps each optimizer ``--steps`` times on its own copy of the same tensors (AdamW, the
benchmarks' hyperparameters) and the rounds alternate the order, so load from other jobs hits both
alike; the figure is the median of the rounds' per-step medians and ``spread`` the slowest round
over the fastest. The last column checks that both computed the same update (largest difference
after the timed steps, relative to the largest weight). DeepSpeedCPUAdam needs ``deepspeed`` and
its JIT-built ``cpu_adam`` op (a C++ compiler); without it its rows say why. Writes
``benchmarks/results/offload_optimizer.json`` and prints a markdown table with the CPU model and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _torch_adamw(params: list[torch.Tensor]):
    return torch.optim.AdamW(params, fused=True, **ADAMW)


def _deepspeed_adam(params: list[torch.Tensor]):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, adamw_mode=True, **ADAMW)


def _time_steps(make, numel: int, steps: int) -> tuple[float, torch.Tensor]:
    """Median seconds per ``step()`` of the optimizer ``make`` builds on one flat shard; its weights after."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(numel, generator=g) * 0.02)
    p.grad = torch.randn(numel, generator=g) * 1e-3
    opt = make([p])
    opt.step()  # state allocation and any JIT build out of the timing
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), p.detach()


def measure(numel: int, rounds: int, steps: int) -> dict:
    impls = {"torch fused AdamW": _torch_adamw, "DeepSpeedCPUAdam": _deepspeed_adam}
    per_round: dict[str, list[float]] = {k: [] for k in impls}
    errors: dict[str, str] = {}
    weights: dict[str, torch.Tensor] = {}
    for r in range(rounds):
        for name in (list(impls) if r % 2 == 0 else list(reversed(impls))):
            if name in errors:
                continue
            try:
                t, weights[name] = _time_steps(impls[name], numel, steps)
                per_round[name].append(t)
            except Exception as e:  # noqa: BLE001 - no deepspeed / no compiler: say so, keep the other row
                errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
    out = {}
    ref = weights.get("torch fused AdamW")
    for name, ts in per_round.items():
        if name in errors:
            out[name] = {"error": errors[name]}
            continue
        diff = None
        if ref is not None and name in weights:
            diff = float((weights[name] - ref).abs().max() / ref.abs().max())
        out[name] = {"ms_per_step": 1e3 * statistics.median(ts), "spread": max(ts) / min(ts) - 1,
                     "rounds_ms": [round(1e3 * t, 2) for t in ts], "GB_per_s": numel * 16 / statistics.median(ts) / 1e9,
                     "max_rel_diff_vs_torch": diff}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", default="10e6,45e6,150e6", help="comma list of shard sizes (elements)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5, help="timed steps per optimizer per round")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a rank runs with OMP_NUM_THREADS=1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(HERE))
    from gpu_check import cpu_model

    meta = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_model(),
            "cores": os.cpu_count(), "threads": args.threads, "torch": torch.__version__,
            "command": " ".join(["python", "benchmarks/bench_offload.py", *(argv or sys.argv[1:])])}
    results = {}
    print(f"{meta['date']}, {meta['cpu']}, threads {args.threads}: `{meta['command']}`\n")
    print("| shard elements | optimizer | ms/step (median) | spread | per round | GB/s (16 B/element) | "
          "max rel diff vs torch |\n|---|---|---:|---:|---|---:|---:|")
    for numel in (int(float(x)) for x in args.numel.split(",")):
        results[numel] = measure(numel, args.rounds, args.steps)
        for name, r in results[numel].items():
            if "error" in r:
                print(f"| {numel:.3g} | {name} | {r['error']} | | | | |")
                continue
            print(f"| {numel:.3g} | {name} | {r['ms_per_step']:.2f} | {r['spread']:.0%} | {r['rounds_ms']} | "
                  f"{r['GB_per_s']:.2f} | {r['max_rel_diff_vs_torch']:.2g} |", flush=True)
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "offload_optimizer.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
