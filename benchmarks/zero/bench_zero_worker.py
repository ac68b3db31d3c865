"""One rank of one bench_zero.py mode (started by torchrun): build the mode, time its steps, report.

    torchrun --nproc-per-node 2 benchmarks/zero/bench_zero_worker.py --mode sw2 --out r.json [--steps 10 ...]

Every mode trains the same model from the same seed on the same batches; rank 0 writes one JSON
with the slowest rank's step times, the forward / backward / step split, model-state bytes per
rank (live tensor storages right after a backward, deduplicated), the losses and, for shardwise,
its bytes moved per collective kind. ``bench_zero.py`` is the driver that runs the modes and
renders the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_report import ADAMW, BUCKET, MODES  # noqa: E402


def _live_storages() -> dict[int, int]:
    """data_ptr -> bytes of every tensor storage Python can reach (DTensors by their local shard)."""
    import torch

    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        DTensor = ()  # noqa: N806
    out: dict[int, int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        try:
            t = obj.to_local() if isinstance(obj, DTensor) else obj
            if t.device.type == "meta":
                continue
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
        except Exception:  # noqa: BLE001 - wrapper subclasses without storage, freed storages
            continue
        if n and ptr:
            out[ptr] = max(out.get(ptr, 0), n)
    return out


def _model_state_bytes(baseline: dict[int, int]) -> int:
    gc.collect()
    return sum(n for ptr, n in _live_storages().items() if ptr not in baseline)


class Runner:
    """forward(batch) -> loss, backward(loss), step(); built per framework."""

    def __init__(self, fwd, bwd, step, report=None, comm=None):
        self.forward, self.backward, self.step = fwd, bwd, step
        self.report, self.comm = report, comm


def _build_ddp(model, args):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(ddp.parameters(), fused=True, **ADAMW)

    def step():
        opt.step()
        opt.zero_grad(set_to_none=False)

    return Runner(lambda b: ddp(**b).loss, lambda loss: loss.backward(), step)


def _build_fsdp2(model, precision):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if precision == "bf16" else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return _plain_loop(model, torch.optim.AdamW(model.parameters(), fused=True, **ADAMW))


def _build_shardwise_fn(model, stage, precision):
    """shardwise's functional API in FSDP2's loop: shard(), then any torch optimizer on the shards."""
    import torch

    import shardwise

    model = shardwise.shard(model, stage=stage, mixed_precision=precision, bucket_size=BUCKET, overlap_comm=True)
    opt = shardwise.ShardedOptimizer(model, torch.optim.AdamW, fused=True, **ADAMW)
    return _plain_loop(model, opt, comm=lambda: model.sharding.comm.stats.as_dict())


def _plain_loop(model, opt, **kw) -> Runner:
    """model(**b).loss; loss.backward(); opt.step(); opt.zero_grad()."""
    def step():
        opt.step()
        opt.zero_grad()

    return Runner(lambda b: model(**b).loss, lambda loss: loss.backward(), step, **kw)


def _offload() -> bool:
    """``--offload-optimizer`` (passed to the ranks as BENCH_OFFLOAD_OPTIMIZER=1)."""
    return os.environ.get("BENCH_OFFLOAD_OPTIMIZER") == "1"


def _ds_config(stage: int, precision: str, micro: int) -> dict:
    """The config keys shardwise's engine and DeepSpeed share."""
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET}
    if _offload() and stage > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if stage > 0 and os.environ.get("BENCH_ZERO_EXTRA"):  # an experiment's extra keys, e.g. no prefetch
        zero.update(json.loads(os.environ["BENCH_ZERO_EXTRA"]))
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0, "steps_per_print": 10**9, "bf16": {"enabled": precision == "bf16"},
            "zero_optimization": zero}


def shared_zero_section() -> dict:
    """The ``zero_optimization`` keys every shardwise and DeepSpeed mode shares (for the doc)."""
    return {k: v for k, v in _ds_config(0, "fp32", 1)["zero_optimization"].items() if k != "stage"}


def _build_shardwise(model, stage, precision, micro):
    import shardwise

    cfg = {**_ds_config(stage, precision, micro),
           "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}}}
    engine, *_ = shardwise.initialize(model=model, config=cfg)

    def fwd(b):
        return engine(**b).loss

    return Runner(fwd, engine.backward, engine.step, report=engine.memory_report, comm=engine.comm_stats)


def _build_deepspeed(model, stage, precision, micro):
    import deepspeed
    import torch

    cfg = {**_ds_config(stage, precision, micro), "wall_clock_breakdown": False,
           "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
    if _offload():  # DeepSpeed's own offload path: its config AdamW becomes DeepSpeedCPUAdam
        cfg["optimizer"] = {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        opt = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)

    def fwd(b):
        return engine(**b).loss

    return Runner(fwd, engine.backward, engine.step)


def import_shardwise_from(src: str) -> None:
    """Make ``import shardwise`` load ``src/shardwise`` (ahead of an editable install's finder)."""
    import importlib.util

    pkg = Path(src) / "shardwise"
    spec = importlib.util.spec_from_file_location("shardwise", pkg / "__init__.py",
                                                  submodule_search_locations=[str(pkg)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["shardwise"] = mod
    spec.loader.exec_module(mod)


def worker(args) -> None:
    if os.environ.get("BENCH_SHARDWISE_SRC"):
        import_shardwise_from(os.environ["BENCH_SHARDWISE_SRC"])
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    framework, stage, precision = MODES[args.worker]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    from shardwise.cli.train_job import REPO_DATA, ByteTextDataset, build_model

    dataset = ByteTextDataset(REPO_DATA, args.seq)
    gc.collect()
    baseline = _live_storages()
    if args.model.endswith(".json"):  # a size of bench_scaling.py: a Llama config, byte-level vocabulary
        from shardwise.train.model import ModelSource
        from shardwise.train.model import build_model as build_from_source

        model = build_from_source(ModelSource("config", args.model, Path(args.model)), 256, args.seq, args.seed, 0)
    else:
        model = build_model(args.model, args.seq, args.seed)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    if framework == "ddp":
        runner = _build_ddp(model, args)
    elif framework == "fsdp2":
        runner = _build_fsdp2(model, precision)
    elif framework == "shardwise":
        runner = _build_shardwise(model, stage, precision, args.micro)
    elif framework == "shardwise-fn":
        runner = _build_shardwise_fn(model, stage, precision)
    else:
        runner = _build_deepspeed(model, stage, precision, args.micro)

    def batch(i: int) -> dict:
        g = torch.Generator().manual_seed(args.seed * 1000 + i)
        idx = torch.randint(len(dataset), (world * args.micro,), generator=g)[rank * args.micro:]
        ids = torch.stack([dataset[int(j)]["input_ids"] for j in idx[:args.micro]])
        return {"input_ids": ids, "labels": ids, "use_cache": False}

    prof = None
    if args.profile_dir:
        from torch.profiler import ProfilerActivity, profile, schedule

        prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False,
                       schedule=schedule(wait=0, warmup=args.warmup, active=args.steps, repeat=1))
        prof.start()
    times, losses = [], []
    total = args.warmup + args.steps
    for i in range(total + 1):
        b = batch(i)
        dist.barrier()
        t0 = time.perf_counter()
        loss = runner.forward(b)
        t1 = time.perf_counter()
        runner.backward(loss)
        t2 = time.perf_counter()
        if i == total:  # one extra, untimed step: model states with grads present
            mem_after_backward = _model_state_bytes(baseline)
            report_after_backward = runner.report() if runner.report else None
        runner.step()
        t3 = time.perf_counter()
        losses.append(float(loss.detach().float()))
        if i < total:
            times.append((t1 - t0, t2 - t1, t3 - t2))
        if prof is not None and i < total:
            prof.step()
    mem_after_step = _model_state_bytes(baseline)
    if prof is not None:
        prof.stop()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        Path(args.profile_dir, f"profile_rank{rank}.txt").write_text(table)
        prof.export_chrome_trace(str(Path(args.profile_dir, f"trace_rank{rank}.json")))

    mine = {"rank": rank, "times": times, "losses": losses, "mem_after_backward": mem_after_backward,
            "mem_after_step": mem_after_step, "memory_report": report_after_backward,
            "comm_stats": runner.comm() if runner.comm else None}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        steps = [max(r["times"][i][0] + r["times"][i][1] + r["times"][i][2] for r in every)
                 for i in range(args.warmup, total)]
        split = [statistics.median(r["times"][i][k] for i in range(args.warmup, total) for r in every)
                 for k in range(3)]
        out = {
            "mode": args.worker, "framework": framework, "stage": stage, "precision": precision,
            "params": n_params, "world": world, "micro": args.micro, "seq": args.seq,
            "step_ms_median": 1e3 * statistics.median(steps), "step_ms_min": 1e3 * min(steps),
            "step_ms_all": [round(1e3 * s, 2) for s in steps],
            "fwd_ms": 1e3 * split[0], "bwd_ms": 1e3 * split[1], "opt_ms": 1e3 * split[2],
            "model_state_bytes": [max(r["mem_after_backward"], r["mem_after_step"]) for r in every],
            "memory_report": [r["memory_report"] for r in every],
            "comm_stats": every[0]["comm_stats"], "threads": torch.get_num_threads(),
            "loss_last_timed": losses[total - 1], "losses": losses[:total],
        }
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", dest="worker", required=True, choices=sorted(MODES))
    p.add_argument("--out", required=True, help="rank 0 writes the results JSON here")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--model", default="llama-20m")
    p.add_argument("--profile-dir", default=None)
    return p.parse_args(argv)


if __name__ == "__main__":
    worker(parse_args())
