"""Every monitoring section on, at ZeRO-2 and ZeRO-3, through the native API and the facade (tests/test_monitor.py).

A part (``monitor``) of the 2-rank ``shardwise launch --as-deepspeed`` the pytest process shares
(tests/facade_launch.py), or a launch of its own (``main``): four trainings in one job (``native2``,
``native3`` through ``shardwise.initialize``; ``facade2`` (fp16) and ``facade3`` through ``import
deepspeed``). Each writes its monitors under ``<out>/<name>/``; every rank returns what the loop saw
(its losses, ``get_lr()``, what it printed), rank 0 writes ``results.json``. As a part it leaves the
process as it found it for the next part: W&B's environment and the comms logger's switches (which a
config's ``comms_logger`` section sets for the whole process, as in DeepSpeed) are put back.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import batches, build  # noqa: E402

STEPS, GAS, MICRO, SEQ = 3, 2, 2, 16
RUNS = {"native2": (2, "native", "fp32"), "native3": (3, "native", "fp32"),
        "facade2": (2, "facade", "fp16"), "facade3": (3, "facade", "fp32")}


def config(stage: int, precision: str, out: Path) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3,
                                                        "warmup_num_steps": 4, "warmup_type": "linear"}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 20_000, "allgather_bucket_size": 20_000,
                                 "stage3_param_persistence_threshold": 0},
           "tensorboard": {"enabled": True, "output_path": str(out / "tb"), "job_name": "job"},
           "csv_monitor": {"enabled": True, "output_path": str(out / "csv"), "job_name": "job"},
           "wandb": {"enabled": True, "project": "shardwise-monitor-test", "group": out.name},
           "comms_logger": {"enabled": True, "prof_all": True},
           "flops_profiler": {"enabled": True, "profile_step": 1, "top_modules": 2,
                              "output_file": str(out / "flops.txt")},
           "wall_clock_breakdown": True, "memory_breakdown": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def train(name: str, root: Path) -> dict:
    stage, api, precision = RUNS[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    out = root / name
    model = build("llama")
    if api == "facade":
        import deepspeed

        comm = deepspeed.comm
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config(stage, precision, out))
    else:
        import shardwise

        comm = shardwise.comm
        engine, *_ = shardwise.initialize(model=model, config=config(stage, precision, out))
    data = batches(STEPS, GAS, MICRO * world, SEQ)
    losses, lrs, timers, printed = [], [], [], io.StringIO()
    with contextlib.redirect_stdout(printed):
        for step in range(STEPS):
            seen = []
            for m in range(GAS):
                ids = data[step, m, rank * MICRO:(rank + 1) * MICRO]
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                seen.append(float(loss.detach()))
            losses.append(seen)
            lrs.append(engine.get_lr()[0])
            timers.append(engine.get_wall_clock_timers())
        summary = comm.log_summary(return_dict=True)
    result = {"losses": losses, "lrs": lrs, "timers": timers, "printed": printed.getvalue(),
              "comm_stats": engine.comm_stats(), "samples": engine.global_samples,
              "writers": len(engine.monitor.monitors.writers), "profile": engine.monitor.last_profile,
              "summary": {op: {str(k): v for k, v in sizes.items()} for op, sizes in summary["summary"].items()},
              "numel": sum(p.numel() for p in model.parameters())}
    engine.destroy()  # closes the monitors (the W&B run finishes)
    comm.reset_log()
    return result


WANDB_ENV = ("WANDB_MODE", "WANDB_DIR", "WANDB_SILENT")


def main_at(root: Path) -> None:
    """The four trainings, their monitors and ``results.json`` under ``root`` (the world is made if
    no earlier part made it: ``init_distributed`` uses one that is up)."""
    import shardwise
    from shardwise.comm.log import COMMS_LOG

    shardwise.init_distributed()
    if "transformers" in sys.modules:  # an earlier part's ZeRO-3 TrainingArguments may still be alive: its
        # process-wide HF DeepSpeed config would build the models here under zero.Init (a process of its own has none)
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
    root.mkdir(parents=True, exist_ok=True)
    saved_env = {k: os.environ.get(k) for k in WANDB_ENV}
    saved_log = dict(vars(COMMS_LOG))
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(root), WANDB_SILENT="true")
    try:
        results = {}
        for name in RUNS:
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, train(name, root))
            results[name] = per_rank
        if dist.get_rank() == 0:
            (root / "results.json").write_text(json.dumps(results))
        dist.barrier()
    finally:
        for k, v in saved_env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        COMMS_LOG.reset()
        vars(COMMS_LOG).update({k: v for k, v in saved_log.items() if k not in ("records", "_lock")})


def main() -> None:
    main_at(Path(sys.argv[1]))


if __name__ == "__main__":
    main()
