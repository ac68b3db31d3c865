"""Model-state memory per rank of each master mode at ZeRO-3, beside FSDP2 with the same precision policy.

Two gloo ranks on the CPU train ``llama-20m`` (shardwise.cli.train_job) a few AdamW steps in bf16 compute;
after a backward and after a step each rank counts the bytes of every live tensor storage the job
created (params, grads, masters, optimizer state, buffers; deduplicated by storage, as
bench_zero_worker.py counts), and the larger of the two is reported. Modes:

* ``sw-fp32``: shardwise ZeRO-3, fp32 masters (the default): 2 + 12 bytes per parameter, all /N (the
  fp32 master is the parameters' persistent copy: no 16-bit shard beside it, zero/store.py);
* ``sw-master``: ``bf16_master_weights_and_grads`` (fp32 moments) with the Kahan buffer: 14/N;
* ``sw-states``: + ``bf16_optimizer_states``, Kahan: 10/N;  ``sw-states-nearest``: no buffer, 8/N
  (``sw-states-stochastic``, on request: 8/N);
* ``fsdp2-fp32``: FSDP2 with fp32 parameters and ``MixedPrecisionPolicy(param_dtype=bf16)`` (fp32
  sharded params = the master, fp32 grads, fp32 moments: 16/N), the policy of ``sw-fp32``;
* ``fsdp2-bf16``: FSDP2 over bf16 parameters (bf16 grads and AdamW moments: 8/N), the policy of
  ``sw-states-nearest``.

    PYTHONPATH=. .venv/bin/python benchmarks/precision/bench_precision_memory.py [--model llama-20m] [--steps 2]
    PYTHONPATH=. .venv/bin/python benchmarks/precision/bench_precision_memory.py --peak --checkpointing \
        --steps 1 --micro 1 \
        --seq 512 --modes sw-fp32,sw-states,sw-states-stochastic,sw-states-nearest,fsdp2-fp32,fsdp2-bf16 \
        --json benchmarks/results/precision_peak.json

``--peak`` also measures the peak of a training step after the others (forward, backward, optimizer step), the way
DeepSpeed's example reports its 31.4 -> 18.9 GB (``torch.cuda.max_memory_allocated`` of a step, with
activation checkpointing: ``--checkpointing``): on the CPU, the live bytes before the step plus the
highest running sum of the allocator's allocations and frees during it (``torch.profiler`` with
``profile_memory``: every CPU allocation of the process's ops, activations and transients included).

``--breakdown`` (with ``--peak``) says what is live at that peak instant: every block the step allocated and has
not freed by then, summed by phase (forward, backward, step), the innermost frame of the library that allocated
it and its aten op, from the profiler's Chrome trace (its ``[memory]`` events carry the block's address);
``--prefetch N`` sets ``stage3_prefetch_bucket_size``. The breakdown of docs/precision.md:

    PYTHONPATH=. .venv/bin/python benchmarks/precision/bench_precision_memory.py --peak --breakdown --checkpointing \
        --steps 1 --micro 1 --seq 512 --modes sw-fp32,sw-states-nearest,fsdp2-fp32,fsdp2-bf16 \
        --json benchmarks/results/precision_peak_breakdown.json

Results: ``benchmarks/results/precision_memory.json``. The fp32 window of a 16-bit master step
(zero/low_precision.py, transient, 4M elements x 16 bytes at most) is not live after the step and is
not counted; neither are FSDP2's unsharded all-gather buffers, freed after each layer.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
MODES = ("sw-fp32", "sw-master", "sw-states", "sw-states-nearest", "fsdp2-fp32", "fsdp2-bf16")
EXTRA_MODES = ("sw-states-stochastic",)  # --modes only: the memory of nearest, plus its random bits per window


def live_bytes(baseline: set[int]) -> int:
    """Bytes of every tensor storage Python reaches that was not there before the model was built."""
    import torch
    from torch.distributed.tensor import DTensor

    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        try:
            t = obj.to_local() if isinstance(obj, DTensor) else obj
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
        except Exception:  # noqa: BLE001 - tensor subclasses without a storage, freed storages
            continue
        if n and ptr and ptr not in baseline:
            seen[ptr] = max(seen.get(ptr, 0), n)
    return sum(seen.values())


def storages() -> set[int]:
    import torch

    gc.collect()
    return {o.untyped_storage().data_ptr() for o in gc.get_objects() if isinstance(o, torch.Tensor)
            and o.device.type != "meta" and not o.is_sparse}


def _open_frames(trace: dict, tid: int, start: float, end: float) -> list[tuple[float, float, str]]:
    """The timed events (ops, Python frames, record_function marks) of thread ``tid`` in [start, end]."""
    return sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in trace["traceEvents"]
                  if e.get("ph") == "X" and e.get("tid") == tid and start <= e["ts"] <= end)


def _where(stack: list[tuple[float, float, str]]) -> str:
    """The innermost frame of the library that allocated (shardwise, transformers, torch.optim/fsdp/
    distributed) and the aten op under it: what a live block at the peak is."""
    frames = [n for _, _, n in stack]
    ops = [n for n in frames if n.startswith("aten::")]
    lib = [n for n in frames if any(k in n for k in ("shardwise/", "transformers/", "torch/optim/",
                                                     "torch/distributed/", "torch/utils/checkpoint"))]
    phase = next((n for n in frames if n.startswith("phase:")), "phase:?")
    return f"{phase} | {lib[-1] if lib else (frames[-1] if frames else '?')} | {ops[-1] if ops else '-'}"


def breakdown(trace_path: str) -> dict:
    """Which blocks are live at the measured step's peak: every allocation of the step not yet freed at the
    peak instant, summed by (phase, innermost library frame, aten op), and the pre-step blocks it freed
    before then. Read from the profiler's Chrome trace (``[memory]`` events carry the block's address)."""
    trace = json.loads(Path(trace_path).read_text())
    mark = next(e for e in trace["traceEvents"] if e.get("name") == "measured_step" and e.get("ph") == "X")
    start, end, tid = mark["ts"], mark["ts"] + mark["dur"], mark["tid"]
    mem = sorted((e["ts"], e["args"]["Bytes"], e["args"]["Addr"], e.get("tid")) for e in trace["traceEvents"]
                 if e.get("name") == "[memory]" and start <= e["ts"] <= end)
    total = high = 0
    peak_ts = start
    for ts, nbytes, _, _ in mem:
        total += nbytes
        if total > high:
            high, peak_ts = total, ts
    frames, live, freed_before, stack, i = _open_frames(trace, tid, start, end), {}, 0, [], 0
    for ts, nbytes, addr, thread in mem:
        if ts > peak_ts:
            break
        while i < len(frames) and frames[i][0] <= ts:
            stack = [f for f in stack if f[1] >= frames[i][0]] + [frames[i]]
            i += 1
        stack = [f for f in stack if f[1] >= ts]
        if nbytes > 0:
            live[addr] = (nbytes, _where(stack) if thread == tid else f"thread {thread}")
        elif addr in live:
            del live[addr]
        else:
            freed_before -= nbytes
    rows: dict[str, int] = {}
    for nbytes, where in live.values():
        rows[where] = rows.get(where, 0) + nbytes
    top = sorted(rows.items(), key=lambda kv: -kv[1])
    live_total = sum(rows.values())
    # a block freed on one thread whose address another reused first is lost to the walk: said, not hidden
    return {"peak_above_start": high, "freed_pre_step_blocks": freed_before, "live_step_allocations": live_total,
            "unattributed": high - (live_total - freed_before), "by_site": [[w, b] for w, b in top if b >= 2**16]}


def step_peak(run_step, base: set[int], trace_path: str | None = None) -> tuple[int, int]:
    """(live bytes before, peak bytes during) one training step: the live bytes at its start plus the highest
    running sum of the CPU allocator's allocations minus frees that ``torch.profiler`` records in it.

    The profiler cannot see the free of a block allocated before it started, so a first step runs under it
    unmeasured: whatever the measured step frees (the last step's gradients, buckets, batch) was allocated
    in that step or in the measured one, and its free is counted."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=trace_path is not None) as prof:
        run_step()
        before = live_bytes(base)
        with record_function("measured_step"):
            run_step()
    if trace_path is not None:
        prof.export_chrome_trace(trace_path)
    events = list(prof.profiler.kineto_results.events())
    mark = next(e for e in events if e.name() == "measured_step")
    start, end = mark.start_ns(), mark.start_ns() + mark.duration_ns()
    total = high = 0
    for e in sorted((e for e in events if e.name() == "[memory]" and start <= e.start_ns() <= end),
                    key=lambda e: e.start_ns()):
        total += e.nbytes()
        high = max(high, total)
    return before, before + high


def _shardwise(model, mode: str, zero: dict):
    import shardwise

    keys = {"sw-fp32": {}, "sw-master": {"bf16_master_weights_and_grads": True}}.get(
        mode, {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True})
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 0,
           "bf16": {"enabled": True, **keys},
           "shardwise": {"master_update": next((u for u in ("nearest", "stochastic") if u in mode), "kahan")},
           "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    return lambda b: engine(**b).loss, engine.backward, engine.step, engine.memory_report


def _fsdp2(model, mode: str, zero: dict):  # noqa: ARG001 - FSDP2 prefetches one unit, always
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mode == "fsdp2-bf16":
        model.to(torch.bfloat16)
        mp = MixedPrecisionPolicy()
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)

    def step():
        opt.step()
        opt.zero_grad()

    return lambda b: model(**b).loss, lambda loss: loss.backward(), step, None


def worker(rank: int, world: int, mode: str, model_name: str, steps: int, out: str, port: int,
           peak_opts: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from shardwise.cli.train_job import build_model

    base = storages()
    model = build_model(model_name, 128, 1234)
    model.train()
    if peak_opts.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = sum(p.numel() for p in model.parameters())
    zero = {"stage3_prefetch_bucket_size": peak_opts["prefetch"]} if peak_opts.get("prefetch") is not None else {}
    fwd, bwd, step, report = (_shardwise if mode.startswith("sw") else _fsdp2)(model, mode, zero)
    peak, rep, micro, seq = 0, None, peak_opts.get("micro", 2), peak_opts.get("seq", 128)
    for i in range(steps):
        g = torch.Generator().manual_seed(i * world + rank)
        ids = torch.randint(0, 256, (micro, seq), generator=g)
        loss = fwd({"input_ids": ids, "labels": ids})
        bwd(loss)
        peak = max(peak, live_bytes(base))
        rep = report() if report is not None else None  # shardwise's own count, after a backward
        step()
        peak = max(peak, live_bytes(base))
    row = {"rank": rank, "bytes": peak, "loss": float(loss.detach().float()), "memory_report": rep}
    if peak_opts.get("peak"):  # two more steps, the second's peak (the moments exist: the steady state's step)
        ids = torch.randint(0, 256, (micro, seq), generator=torch.Generator().manual_seed(steps * world + rank))

        def one_step() -> None:
            from torch.profiler import record_function

            with record_function("phase:forward"):
                loss = fwd({"input_ids": ids, "labels": ids})
            with record_function("phase:backward"):
                bwd(loss)
            with record_function("phase:step"):
                step()

        trace = f"{out}.rank{rank}.trace.json" if peak_opts.get("breakdown") else None
        row["before_step_bytes"], row["step_peak_bytes"] = step_peak(one_step, base, trace)
        if trace is not None:
            row["breakdown"] = breakdown(trace)
    every: list = [None] * world
    dist.all_gather_object(every, row)
    if rank == 0:
        Path(out).write_text(json.dumps({"mode": mode, "params": params, "per_rank": every}))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-20m")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", default="benchmarks/results/precision_memory.json")
    p.add_argument("--peak", action="store_true", help="also the peak of a later step (torch.profiler)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing (HF's, per layer)")
    p.add_argument("--breakdown", action="store_true",
                   help="with --peak: what is live at the peak instant, by allocating site (profiler trace)")
    p.add_argument("--prefetch", type=int, default=None,
                   help="stage3_prefetch_bucket_size (elements; default: the config's, 50M)")
    p.add_argument("--micro", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    args = p.parse_args(argv)
    peak_opts = {"peak": args.peak, "breakdown": args.breakdown, "prefetch": args.prefetch,
                 "checkpointing": args.checkpointing, "micro": args.micro, "seq": args.seq}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, mode in enumerate(args.modes.split(",")):
            out = os.path.join(tmp, f"{mode}.json")
            mp.spawn(worker, args=(2, mode, args.model, args.steps, out, 29650 + i, peak_opts), nprocs=2, join=True)
            results[mode] = json.loads(Path(out).read_text())
    psi = next(iter(results.values()))["params"]
    table = {m: {"bytes_per_rank": max(x["bytes"] for x in r["per_rank"]),
                 "bytes_per_param_x_N": round(2 * max(x["bytes"] for x in r["per_rank"]) / psi, 2)}
             for m, r in results.items()}
    for m, r in results.items():
        if args.peak:
            table[m]["step_peak_bytes"] = max(x["step_peak_bytes"] for x in r["per_rank"])
    if args.peak and "sw-fp32" in table:  # each peak against the fp32-master run's, as DeepSpeed's 18.9 / 31.4
        for t in table.values():
            t["step_peak_vs_sw_fp32"] = round(t["step_peak_bytes"] / table["sw-fp32"]["step_peak_bytes"], 4)
    res = {"model": args.model, "params": psi, "world": 2, "stage": 3, "steps": args.steps, "modes": table,
           "batch": {"micro": args.micro, "seq": args.seq, "checkpointing": args.checkpointing},
           "raw": results, "cmd": " ".join(["benchmarks/precision/bench_precision_memory.py", *(argv or sys.argv[1:])])}
    (ROOT / args.json).write_text(json.dumps(res, indent=1))
    for m, t in table.items():
        mib, per = t["bytes_per_rank"] / 2**20, t["bytes_per_param_x_N"]
        extra = (f"; step peak {t['step_peak_bytes'] / 2**20:8.1f} MiB ({t.get('step_peak_vs_sw_fp32', '-')} "
                 "of sw-fp32's)") if args.peak else ""
        print(f"{m:>18}: {mib:8.1f} MiB per rank = {per:5.2f} bytes x Ψ / N{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
