"""What the direct-call hooks cost the whole-model step at ZeRO-3 (shardwise/zero/stage3/direct_calls.py).

    python benchmarks/zero/bench_direct_calls.py                  # 2 ranks, tiny and llama-20m
    python benchmarks/zero/bench_direct_calls.py --models tiny --rounds 9 --steps 10

One gloo job (torchrun, OMP_NUM_THREADS=1 per rank) per model: ``shardwise.shard(model, stage=3,
persistence_threshold=0)`` (every parameter released between uses, so every module holding
parameters carries the hooks: the worst case), fused AdamW, forward + backward + step. Each round
times ``--steps`` steps with the hooks and ``--steps`` without (removed, then installed again), in
alternating order, so load from other jobs falls on both alike. Printed per model: the median step
of each mode over all rounds (slowest rank), their ratio, and the spread of the per-round ratios;
and, since on a loaded machine that spread hides a small cost, an estimate that load does not move
much: the hooked module calls in one forward (the backward runs no module hooks) times the
measured per-call cost of a hook pair that returns at once, as a share of the step.
The figures go into docs/architecture.md ("Submodules called on their own").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01}


def _model(name: str, seq: int):
    if name == "tiny":  # the tests' 2-layer Llama (tests/tiny_models.py): hooks weigh most here
        from transformers import AutoModelForCausalLM, LlamaConfig

        cfg = LlamaConfig(vocab_size=509, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=False)
        return AutoModelForCausalLM.from_config(cfg), 509
    from shardwise.cli.train_job import build_model

    return build_model(name, seq, seed=0), 256


def _steps(model, opt, n: int, micro: int, seq: int, vocab: int, g) -> list[float]:
    import torch
    import torch.distributed as dist

    times = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (micro, seq), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(float(dt))
    return times


def _dispatch_cost_s(n: int = 20000) -> float:
    """Extra seconds per module call that a pre/post hook pair returning at once adds (PyTorch's
    hook dispatch plus the nested-path check), best of 5 on a hookless ``nn.Identity``."""
    import torch
    from torch import nn

    m, x, state = nn.Identity(), torch.zeros(1), [1]

    def best() -> float:
        out = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                m(x)
            out.append((time.perf_counter() - t0) / n)
        return min(out)

    bare = best()
    handles = [m.register_forward_pre_hook(lambda mod, a: None if state else None),
               m.register_forward_hook(lambda mod, a, o: None if state else None)]
    hooked = best()
    for h in handles:
        h.remove()
    return max(hooked - bare, 0.0)


def _hooked_calls_per_forward(model, hooked_modules: list, vocab: int, seq: int) -> int:
    import torch

    count = [0]
    handles = [m.register_forward_pre_hook(lambda mod, a: count.__setitem__(0, count[0] + 1)) for m in hooked_modules]
    with torch.no_grad():
        model(input_ids=torch.zeros(1, seq, dtype=torch.long))
    for h in handles:
        h.remove()
    return count[0]


def _worker(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    import shardwise
    from shardwise.zero.stage3.direct_calls import DirectCalls

    shardwise.init_distributed(backend="gloo")
    torch.manual_seed(0)
    model, vocab = _model(args.model, args.seq)
    model = shardwise.shard(model, stage=3, persistence_threshold=0)
    opt = shardwise.ShardedOptimizer(model, torch.optim.AdamW, fused=True, **ADAMW)
    fetcher = model.sharding.fetcher
    hooked = len(fetcher.direct.handles) // 2
    modules = [m for m in model.modules() if any(h.id in m._forward_pre_hooks for h in fetcher.direct.handles)]
    calls = _hooked_calls_per_forward(model, modules, vocab, args.seq)
    per_call = _dispatch_cost_s()
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    _steps(model, opt, args.warmup, args.micro, args.seq, vocab, g)
    times: dict[str, list[float]] = {"with": [], "without": []}
    ratios = []
    for r in range(args.rounds):
        per_round = {}
        for mode in (("with", "without") if r % 2 == 0 else ("without", "with")):
            if mode == "without":
                fetcher.direct.remove()
            per_round[mode] = _steps(model, opt, args.steps, args.micro, args.seq, vocab, g)
            if mode == "without":
                fetcher.direct = DirectCalls(fetcher)
            times[mode] += per_round[mode]
        ratios.append(statistics.median(per_round["with"]) / statistics.median(per_round["without"]))
    med = {m: statistics.median(t) for m, t in times.items()}
    return {"model": args.model, "hooked_modules": hooked, "hooked_calls_per_step": calls,
            "dispatch_s_per_call": per_call, "estimate": calls * per_call / med["without"],
            "median_with_s": med["with"],
            "median_without_s": med["without"], "ratio": med["with"] / med["without"],
            "round_ratio_min": min(ratios), "round_ratio_max": max(ratios), "rounds": args.rounds,
            "steps_per_round": args.steps}


def _launch(model: str, args: argparse.Namespace) -> dict:
    out = REPO / "benchmarks" / "results" / f"direct_calls_{model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           __file__, "--worker", "--model", model, "--out", str(out), "--rounds", str(args.rounds),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--seq", str(args.seq),
           "--micro", str(args.micro)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    subprocess.run(cmd, env=env, check=True, timeout=3600)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,llama-20m")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--model", default="tiny")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.worker:
        res = _worker(args)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(args.out).write_text(json.dumps(res, indent=1))
        return
    print("| model | modules hooked (calls per step) | step with hooks | without | ratio (median) | "
          "per-round ratios | dispatch estimate |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        r = _launch(model, args)
        print(f"| {model} | {r['hooked_modules']} ({r['hooked_calls_per_step']}) | {r['median_with_s'] * 1e3:.1f} ms | "
              f"{r['median_without_s'] * 1e3:.1f} ms | {r['ratio']:.3f} | "
              f"{r['round_ratio_min']:.3f}-{r['round_ratio_max']:.3f} | "
              f"{r['dispatch_s_per_call'] * 1e6:.2f} us/call: {100 * r['estimate']:.3f}% |")


if __name__ == "__main__":
    main()
