"""Optimizer offload measured two ways: the whole step against no offload, and the host optimizer against the
host's memory bandwidth. Runs on CUDA when there is a GPU, on CPU otherwise (the same code).

    python benchmarks/offload/bench_offload.py                       # the step and the host optimizer
    python benchmarks/offload/bench_offload.py --smoke               # tiny sizes (the test suite runs it)
    python benchmarks/offload/bench_offload.py --compare-deepspeed   # the optimizer phase alone, vs DeepSpeedCPUAdam

1. **Host memory bandwidth**: STREAM's copy and add over ``--memcpy-mib`` MiB fp32 arrays, the best of 5
   each, counted as bytes read + bytes written (what AdamW's traffic is counted in below).
2. **Host optimizer**: torch's fused CPU AdamW (what ``offload_optimizer`` steps the fp32 masters with)
   on one flat shard of ``--numel`` elements: parameters per second, and its memory traffic (reads
   parameter, gradient, both moments: 16 B; writes parameter and moments: 12 B; 28 B a parameter)
   as a fraction of the memcpy bandwidth: near 1, the optimizer is as fast as the memory allows.
3. **The step**: a Llama trained by the engine at ZeRO-2 and ZeRO-3 without and with
   ``offload_optimizer`` (``pin_memory`` on CUDA), the modes alternating over ``--rounds``; seconds
   per step (median of each run's steps after a warm-up, then median of the rounds) and the offload
   step over the no-offload step, beside what the host optimizer alone needs for the model's parameters.

``--compare-deepspeed``: the earlier figure (docs/benchmarks.md): one fp32 shard with its gradient,
torch's fused CPU AdamW against DeepSpeed's ``DeepSpeedCPUAdam`` (needs ``deepspeed`` and its JIT-built
``cpu_adam`` op; without it its rows say why), 7 interleaved rounds. Every mode writes a JSON under
``benchmarks/results/`` (``--out``) with the machine, the date and the command, and prints a markdown table.
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
sys.path.insert(0, str(HERE.parent))  # benchmarks/: the shared helpers in shared/
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


# -- the host's memory bandwidth and the host optimizer against it ----------------------------------------------
ADAMW_BYTES = 28  # fp32 AdamW per parameter: reads p, g, m, v (16 B), writes p, m, v (12 B)


def memcpy_gbps(mib: int, repeats: int = 5) -> dict:
    """Host memory bandwidth, STREAM's way: GB/s of a copy (``b = a``: 2 streams) and of an add
    (``c = a + b``: 3 streams) over ``mib`` MiB arrays, bytes read + written, the best of ``repeats``
    for each (the bandwidth is what the memory allows; another job on the machine only ever slows
    a run down), and the better of the two as the machine's figure."""
    a = torch.ones(mib << 18)  # fp32: 4 bytes an element
    b, c = torch.ones_like(a), torch.empty_like(a)
    ops = {"copy": (lambda: b.copy_(a), 2), "add": (lambda: torch.add(a, b, out=c), 3)}
    out = {}
    for name, (op, streams) in ops.items():
        op()  # pages touched out of the timing
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            op()
            best = min(best, time.perf_counter() - t0)
        out[f"{name}_GBps"] = streams * a.numel() * 4 / best / 1e9
    out["GBps"] = max(out["copy_GBps"], out["add_GBps"])
    return out


def host_optimizer(numel: int, steps: int) -> dict:
    """torch's fused CPU AdamW on one flat fp32 shard: parameters per second and its traffic in GB/s."""
    t, _ = _time_steps(_torch_adamw, numel, steps)
    return {"numel": numel, "ms_per_step": 1e3 * t, "params_per_s": numel / t,
            "GB_per_s": numel * ADAMW_BYTES / t / 1e9}


# -- the engine's step without and with offload_optimizer -------------------------------------------------------
SHAPES = {"smoke": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 4, "vocab_size": 512},
          "cpu": {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 6,
                  "num_key_value_heads": 6, "vocab_size": 8192},  # 17M parameters
          "cuda": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24, "num_attention_heads": 16,
                   "num_key_value_heads": 16, "vocab_size": 32000}}  # 0.37B parameters


def _engine_step_s(shape: dict, stage: int, offload: bool, micro: int, seq: int, steps: int) -> dict:
    """One engine, ``steps`` timed steps after one warm-up: median seconds per step, parameters."""
    from shared.models import engine_config, llama

    import shardwise

    model = llama(shape)
    cfg = engine_config(stage, "fp32", "optimizer" if offload else None, micro=micro)
    engine, _, _, _ = shardwise.initialize(model=model, config=cfg)
    device = next(iter(engine.module.parameters())).device
    ids = torch.randint(0, shape["vocab_size"], (steps + 1, micro, seq), generator=torch.Generator().manual_seed(1))
    times = []
    for batch in ids.to(device):
        t0 = time.perf_counter()
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return {"s_per_step": statistics.median(times[1:]), "params": sum(p.numel() for p in model.parameters()),
            "device": str(device)}


def step_table(shape: dict, micro: int, seq: int, rounds: int, steps: int) -> list[dict]:
    """ZeRO-2 and ZeRO-3, each without and with offload_optimizer, the order alternating per round."""
    modes = [(stage, off) for stage in (2, 3) for off in (False, True)]
    per: dict = {m: [] for m in modes}
    info: dict = {}
    for r in range(rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:
            res = _engine_step_s(shape, *m, micro, seq, steps)
            per[m].append(res["s_per_step"])
            info = res
    rows = []
    for stage in (2, 3):
        base, off = statistics.median(per[(stage, False)]), statistics.median(per[(stage, True)])
        rows.append({"stage": stage, "device": info["device"], "params": info["params"], "tokens_per_step": micro * seq,
                     "s_per_step": base, "s_per_step_offload": off, "offload_over_no_offload": off / base,
                     "rounds_s": [round(x, 4) for x in per[(stage, False)]],
                     "rounds_offload_s": [round(x, 4) for x in per[(stage, True)]]})
    return rows


def run_offload(args, meta: dict) -> dict:
    """The three measurements and their tables; the report (also written to ``--out``)."""
    import shardwise
    from shardwise.comm import compute_device

    shardwise.init_distributed()
    size = "smoke" if args.smoke else compute_device().type
    mib = args.memcpy_mib if not args.smoke else 16
    memory = memcpy_gbps(mib)
    bw = memory["GBps"]
    opt = host_optimizer(int(float(args.numel)) if not args.smoke else 1 << 18, args.steps)
    opt["fraction_of_memcpy"] = opt["GB_per_s"] / bw
    micro, seq = {"smoke": (2, 32), "cpu": (2, 128), "cuda": (4, 512)}[size]
    rounds, timed = (1, 2) if args.smoke else (args.rounds, args.steps)
    steps = step_table(SHAPES[size], micro, seq, rounds, timed)
    for row in steps:  # what the host optimizer alone needs for this model's fp32 masters, at the rate above
        row["host_optimizer_s"] = row["params"] / opt["params_per_s"]
    print(f"host memory {bw:.2f} GB/s (best of copy {memory['copy_GBps']:.2f} and add {memory['add_GBps']:.2f}, read + "
          f"write, {mib} MiB arrays); fused CPU AdamW on {opt['numel']:.3g} elements: "
          f"{opt['ms_per_step']:.2f} ms, {opt['params_per_s'] / 1e6:.1f}M params/s, {opt['GB_per_s']:.2f} GB/s at "
          f"{ADAMW_BYTES} B/param = {opt['fraction_of_memcpy']:.0%} of memcpy\n")
    print("| ZeRO | device | params | s/step | s/step offload | offload / none | host optimizer alone s |\n"
          "|---|---|---:|---:|---:|---:|---:|")
    for r in steps:
        print(f"| {r['stage']} | {r['device']} | {r['params'] / 1e6:.1f}M | {r['s_per_step']:.4f} | "
              f"{r['s_per_step_offload']:.4f} | {r['offload_over_no_offload']:.2f} | {r['host_optimizer_s']:.4f} |")
    return {"meta": meta, "memcpy_GBps": bw, "memory": memory, "host_optimizer": opt, "steps": steps}


def compare_deepspeed(args, meta: dict) -> dict:
    """The optimizer phase alone: torch fused AdamW against DeepSpeedCPUAdam, per shard size."""
    results = {}
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
    return {"meta": meta, "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round (the suite runs it)")
    p.add_argument("--compare-deepspeed", action="store_true", help="the optimizer phase alone vs DeepSpeedCPUAdam")
    p.add_argument("--numel", default=None, help="host optimizer shard (elements); with --compare-deepspeed a comma "
                   "list (default 10e6,45e6,150e6)")
    p.add_argument("--memcpy-mib", type=int, default=512, help="size of each host bandwidth array (well past the "
                   "caches)")
    p.add_argument("--rounds", type=int, default=None, help="default 3 (--compare-deepspeed: 7)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; a rank of a CPU "
                   "launch runs with OMP_NUM_THREADS=1)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/offload_step_vs_memory.json; "
                   "--compare-deepspeed: offload_optimizer.json)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.rounds = args.rounds or (7 if args.compare_deepspeed else 3)
    args.numel = args.numel or ("10e6,45e6,150e6" if args.compare_deepspeed else "50e6")
    from shared.machine import RESULTS, cpu_model

    meta = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_model(),
            "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "command": " ".join(["python", "benchmarks/offload/bench_offload.py",
                                 *(sys.argv[1:] if argv is None else argv)])}
    print(f"{meta['date']}, {meta['cpu']}, GPU {meta['gpu']}, threads {meta['threads']}: `{meta['command']}`\n")
    report = compare_deepspeed(args, meta) if args.compare_deepspeed else run_offload(args, meta)
    name = "offload_optimizer.json" if args.compare_deepspeed else "offload_step_vs_memory.json"
    out = Path(args.out) if args.out else RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
