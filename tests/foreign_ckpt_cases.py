"""Rank-side runs of test_checkpoint_foreign.py: continue a DeepSpeed / FSDP2 run on shardwise."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from foreign_ckpt_model import ADAMW, STEPS, batch, build, ds_config

import shardwise
from shardwise.utils.tensor_fragment import safe_get_full_fp32_param
from shardwise.zero import GatheredParameters

FIXTURES = Path(__file__).parent / "data" / "foreign_ckpt"


def engine_for(stage: int, bf16: bool, frozen: bool, scheduler: bool = True, sgd: bool = False,
               hf_groups: bool = False):
    """A shardwise engine on the fixtures' config, from another seed (a load must overwrite it all)."""
    cfg = ds_config(stage, dist.get_world_size(), bf16)
    cfg["optimizer"] = {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"]), "torch_adam": True}}
    if sgd:
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    if not scheduler:
        del cfg["scheduler"]
    model = build(seed=123, frozen=frozen)
    params = None
    if hf_groups:  # the HF Trainer's two groups: no weight decay on the norm weights
        named = list(model.named_parameters())
        params = [{"params": [p for n, p in named if "norm" not in n]},
                  {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0}]
    engine, *_ = shardwise.initialize(model=model, model_parameters=params, config=cfg)
    return engine


def continue_from(case: str, stage: int, bf16: bool = False, frozen: bool = False, scheduler: bool = True,
                  **load_kw) -> dict:
    """Load the fixture ``case`` and run steps SAVE_AT..STEPS; losses, state and final fp32 weights."""
    engine = engine_for(stage, bf16, frozen, scheduler)
    path, client = engine.load_checkpoint(str(FIXTURES / case), **load_kw)
    start, lr = engine.global_steps, engine.get_lr()[0]
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(start, STEPS):
        ids = batch(step, rank, world)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss.detach()))
    weights = {}  # fp32 masters of the trained parameters (collective at stage 3), frozen ones as they are
    for n, p in engine.module.named_parameters():
        if p.requires_grad:
            weights[n] = safe_get_full_fp32_param(p).detach().clone()
    with GatheredParameters([p for p in engine.module.parameters() if not p.requires_grad]):
        weights.update({n: p.detach().float().clone() for n, p in engine.module.named_parameters()
                        if not p.requires_grad})
    return {"path": path, "client": client, "start": start, "lr_at_load": lr, "losses": losses,
            "weights": weights if rank == 0 else None, "end": engine.global_steps}


def load_error(case_dir: str, stage: int = 2, sgd: bool = False) -> str:
    """Every rank fails the same way (and none hangs) on a damaged foreign checkpoint."""
    engine = engine_for(stage, False, False, sgd=sgd)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    try:
        engine.load_checkpoint(case_dir)
        msg = "no error"
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {e}"
    with GatheredParameters(engine.module.parameters()):
        same = all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
    return f"{msg} | unchanged={same}"


def trainer_checkpoint(stage: int) -> dict:
    """The HF Trainer's ``checkpoint-2`` loaded (no scheduler: the Trainer ran a constant lr)."""
    engine = engine_for(stage, False, False, scheduler=False, hf_groups=True)
    path, _ = engine.load_checkpoint(str(FIXTURES / "hf_trainer_z2" / "checkpoint-2"))
    masters = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}
    return {"path": path, "steps": engine.global_steps, "masters": masters, "lr": engine.get_lr()[0]}


def fsdp_api_continue(case: str, stage: int) -> list[float]:
    """The FSDP-style front end (``shard`` + ``ShardedOptimizer`` + ``shardwise.load_checkpoint``)
    continues the fixture on the whole batch (one rank); the optimizer at a constant lr."""
    model = shardwise.shard(build(seed=123), stage=stage)
    opt = shardwise.ShardedOptimizer(model, torch.optim.AdamW, **ADAMW)
    _, _ = shardwise.load_checkpoint(str(FIXTURES / case), model, opt)
    losses = []
    for step in range(opt.global_steps, STEPS):
        ids = batch(step, 0, 1)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses
