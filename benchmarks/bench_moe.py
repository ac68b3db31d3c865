"""Expert parallelism: step time and per-rank memory of a small MoE, EP 1 vs EP 2 (one command).

    python benchmarks/bench_moe.py                 # 2 gloo ranks, 4 modes, 3 interleaved rounds
    python benchmarks/bench_moe.py --rounds 5 --steps 4 --experts 16

One job of 2 ranks (OMP_NUM_THREADS=1 each) builds the same Mixtral-style model (fp32, AdamW) four
times, at ZeRO-2 and ZeRO-3, each without EP (every rank holds, or shards, every expert) and with
EP 2 (each rank holds half the experts), and trains them in interleaved rounds so a busy machine
slows every mode alike. It prints the median step time (slowest rank, forward + backward + step)
with its spread, and the tensor bytes per rank (``engine.memory_report()``: parameters, gradients,
fp32 masters, optimizer state) and of the experts alone, as ratios to ZeRO-2 without EP. Tensor
bytes, not RSS (glibc keeps freed memory). The table goes into docs/moe.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODES = [("zero2", 2, None), ("zero2-ep2", 2, 2), ("zero3", 3, None), ("zero3-ep2", 3, 2)]


def _model(args: argparse.Namespace):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("mixtral", vocab_size=1024, hidden_size=args.hidden, intermediate_size=args.ffn,
                               num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                               num_local_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=512,
                               output_router_logits=True, router_aux_loss_coef=0.02, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg)


def _engine(stage: int, ep: int | None, args: argparse.Namespace, world: int):
    import shardwise

    cfg = {"train_micro_batch_size_per_gpu": args.micro, "train_batch_size": args.micro * world,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 10_000}}
    if ep is not None:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": "mixtral"}
    engine, *_ = shardwise.initialize(model=_model(args), config=cfg)
    return engine


def _expert_bytes(engine) -> int:
    """The experts' bytes on this rank: their share (by elements) of each group's parameters,
    gradients, masters and optimizer state (a group holds experts only, or none, under EP)."""
    total = 0
    for g in engine.sharding.all_groups:
        m = g.memory()
        state = engine.optimizer.state.get(g.master, {}) if g.master is not None else {}
        opt = sum(v.numel() * v.element_size() for v in state.values() if hasattr(v, "numel") and v.numel() > 1)
        share = sum(n for name, n in zip(g.names, g.numels, strict=True) if ".experts." in name) / g.numel
        total += int(share * (m["params"] + m["grads"] + m["master_params"] + opt))
    return total


def _steps(engine, ids, n: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    dist.barrier()
    return (time.perf_counter() - t0) / n


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import json

    import torch

    torch.set_num_threads(1)
    import shardwise

    shardwise.init_distributed(backend="gloo")
    engines = {name: _engine(stage, ep, args, world) for name, stage, ep in MODES}
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 1024, (args.micro, args.seq), generator=g)
    for e in engines.values():
        _steps(e, ids, 1)  # warmup (optimizer state allocated)
    times: dict[str, list[float]] = {n: [] for n in engines}
    for _ in range(args.rounds):
        for name, e in engines.items():
            times[name].append(_steps(e, ids, args.steps))
    mem = {}
    for name, e in engines.items():
        rep = e.memory_report()
        mem[name] = {"states": rep["params"] + rep["grads"] + rep["master_params"] + rep["optimizer_states"],
                     "experts": _expert_bytes(e)}
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "mem": mem}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="steps timed per mode per round")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "moe.json"),
                   help="where the rounds' raw times and bytes are kept (the docs' table is printed from them)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import json

    import torch.multiprocessing as mp

    from shardwise.net import free_port

    out = args.out
    mp.spawn(_worker, args=(2, free_port(), args, out), nprocs=2, join=True)
    res = json.loads(Path(out).read_text())
    base_t = statistics.median(res["times"]["zero2"])
    base_m = res["mem"]["zero2"]
    print("| mode | step (median of rounds) | spread | vs zero2 | bytes/rank (states) | vs zero2 | expert bytes/rank |"
          " vs zero2 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, ts in res["times"].items():
        med, m = statistics.median(ts), res["mem"][name]
        print(f"| {name} | {med * 1e3:.0f} ms | {min(ts) * 1e3:.0f}-{max(ts) * 1e3:.0f} | {med / base_t:.2f} | "
              f"{m['states'] / 2**20:.1f} MiB | {m['states'] / base_m['states']:.2f} | "
              f"{m['experts'] / 2**20:.1f} MiB | {m['experts'] / base_m['experts']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
