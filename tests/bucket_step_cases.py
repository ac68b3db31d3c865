"""Rank-side runs for test_bucket_step.py: the per-bucket step-and-publish against the one-step path.

The one-step path is forced by stepping a trivial subclass of the same torch optimizer (the
per-bucket path matches torch's classes by exact type), so both runs use the same kernels and
arithmetic; only the order of the optimizer work and the all-gathers differs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tiny_models import batches, build
from zero_cases import LR, WD, make_config

import shardwise
from shardwise.zero.bucket_step import steps_per_bucket

STEPS, SEQ, MICRO = 3, 16, 2
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"weight_decay": WD}),
              "adamw_fused": (torch.optim.AdamW, {"weight_decay": WD, "fused": True}),
              "sgd_momentum": (torch.optim.SGD, {"momentum": 0.9, "weight_decay": WD})}


def _optimizer(params, name: str, one_step: bool) -> torch.optim.Optimizer:
    cls, kw = OPTIMIZERS[name]
    if one_step:
        cls = type(f"OneStep{cls.__name__}", (cls,), {})
    return cls(params, lr=LR, **kw)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters as read straight after step(): every rank's range must already be updated."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def engine_run(stage: int, opt_name: str, one_step: bool, precision: str = "fp32", offload: bool = False) -> dict:
    """DeepSpeed-style engine with a client optimizer and a WarmupLR scheduler from the config."""
    model = build("llama")
    cfg = make_config(stage, precision=precision, offload=offload, optimizer=False)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                       "warmup_num_steps": STEPS}}
    opt = _optimizer(model.parameters(), opt_name, one_step)
    engine, opt, _, sched = shardwise.initialize(model=model, config=cfg, optimizer=opt)
    per_bucket = steps_per_bucket(engine.optimizer, engine.sharding)
    data, rank = batches(STEPS, 1, MICRO * dist.get_world_size(), SEQ), dist.get_rank()
    after = []
    for s in range(STEPS):
        ids = data[s, 0, rank * MICRO:(rank + 1) * MICRO]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        after.append(_weights(model))
    return {"per_bucket": per_bucket, "buckets": len(engine.groups), "after_step": after,
            "state": opt.state_dict(), "lr": sched.get_last_lr()}


def shard_api_run(stage: int, opt_name: str, one_step: bool) -> dict:
    """FSDP-style ``shardwise.shard`` + ``ShardedOptimizer``, with a torch LR scheduler."""
    model = shardwise.shard(build("llama"), stage=stage, bucket_size=20_000)
    cls, kw = OPTIMIZERS[opt_name]
    if one_step:
        cls = type(f"OneStep{cls.__name__}", (cls,), {})
    opt = shardwise.ShardedOptimizer(model, cls, lr=LR, **kw)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=STEPS)
    per_bucket = steps_per_bucket(opt.optimizer, opt.sharding)
    data, rank = batches(STEPS, 1, MICRO * dist.get_world_size(), SEQ), dist.get_rank()
    after = []
    for s in range(STEPS):
        ids = data[s, 0, rank * MICRO:(rank + 1) * MICRO]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        after.append(_weights(model))
    return {"per_bucket": per_bucket, "buckets": len(opt.sharding.groups), "after_step": after,
            "state": opt.state_dict(), "lr": sched.get_last_lr()}
