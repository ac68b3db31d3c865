"""Rank-side runs of training loops as users write them (issue 20): plain ``loss.backward()`` on the
engine, ``torch.compile`` of sharded models, and the ZeRO stages against each other bit for bit."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tiny_models import batches, build
from zero_cases import make_config

import shardwise
from shardwise.engine.compat import UsageError
from shardwise.zero import GatheredParameters


def _full_weights(model) -> dict[str, torch.Tensor]:
    with GatheredParameters(model.parameters()):  # a no-op below stage 3
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _engine_run(stage: int, precision: str, how: str, steps: int = 2, gas: int = 2, micro: int = 2) -> dict:
    """``how``: 'engine' (engine.backward(loss)) or 'plain' (loss.backward(), engine.scale(loss) in fp16)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    engine, *_ = shardwise.initialize(model=build("llama"), config=make_config(stage, precision=precision,
                                                                               gas=gas, dp=world))
    data = batches(steps, gas, micro * world, 16)
    losses = []
    for s in range(steps):
        for m in range(gas):
            ids = data[s, m, rank * micro:(rank + 1) * micro]
            loss = engine(input_ids=ids, labels=ids).loss
            if how == "engine":
                engine.backward(loss)
            else:
                (engine.scale(loss) if precision == "fp16" else loss).backward()
            engine.step()
            losses.append(float(loss.detach()))
    return {"losses": losses, "weights": _full_weights(engine.module), "steps": engine.global_steps}


def plain_backward_against_engine_backward(stage: int, precision: str) -> dict:
    """Both loops on the same batches; and fp16's plain backward without engine.scale, refused."""
    out = {how: _engine_run(stage, precision, how) for how in ("engine", "plain")}
    if precision == "fp16":
        engine, *_ = shardwise.initialize(model=build("llama"), config=make_config(stage, precision="fp16", gas=2))
        ids = batches(1, 1, 2, 16)[0, 0]
        try:
            engine(input_ids=ids, labels=ids).loss.backward()
            out["unscaled"] = "no error"
        except UsageError as e:
            out["unscaled"] = str(e)
    return out


def weights_at_every_stage(precisions: list[str], steps: int = 1, micro: int = 2) -> dict:
    """The same engine run at stages 0-3 for each precision; rank 0 returns the full weights and
    losses by (precision, stage), every rank the losses it saw."""
    world, rank = dist.get_world_size(), dist.get_rank()
    data = batches(steps, 1, micro * world, 16)
    out = {}
    for precision in precisions:
        for stage in range(4):
            engine, *_ = shardwise.initialize(model=build("llama"), config=make_config(stage, precision=precision,
                                                                                       dp=world))
            losses = []
            for s in range(steps):
                ids = data[s, 0, rank * micro:(rank + 1) * micro]
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
            weights = _full_weights(engine.module)
            out[f"{precision}/{stage}"] = {"losses": losses, "weights": weights if rank == 0 else {}}
    return out


def _train(api: str, stage: int, backend: str | None, steps: int, micro: int = 2) -> dict:
    """``steps`` steps of the FSDP-style loop ('shard') or the engine ('engine'), compiled with
    ``backend`` (None: eager); the losses, full weights and dynamo's graph-break count."""
    from torch._dynamo.utils import counters
    from zero_cases import BETAS, EPS, LR, WD

    torch._dynamo.reset()
    counters.clear()
    world, rank = dist.get_world_size(), dist.get_rank()
    if api == "shard":
        model = shardwise.shard(build("llama"), stage=stage, bucket_size=20_000)
        opt = shardwise.ShardedOptimizer(model, torch.optim.AdamW, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        if backend is not None:
            shardwise.compile(model, backend=backend)
    elif api in ("torch.compile", "model.compile"):  # plain torch, as users write it
        model = shardwise.shard(build("llama"), stage=stage, bucket_size=20_000)
        opt = shardwise.ShardedOptimizer(model, torch.optim.AdamW, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        if backend is not None and api == "torch.compile":
            model = torch.compile(model, backend=backend)
        elif backend is not None:
            model.compile(backend=backend)
    else:
        model, *_ = shardwise.initialize(model=build("llama"), config=make_config(stage, dp=world))
        if backend is not None:
            model.compile(backend=backend, compile_kwargs={})
    data = batches(steps, 1, micro * world, 16)
    losses = []
    for s in range(steps):
        ids = data[s, 0, rank * micro:(rank + 1) * micro]
        loss = model(input_ids=ids, labels=ids).loss
        if api != "engine":
            loss.backward()
            opt.step()
            opt.zero_grad()
        else:
            model.backward(loss)
            model.step()
        losses.append(float(loss.detach()))
    module = getattr(model, "_orig_mod", model) if api != "engine" else model.module
    return {"losses": losses, "weights": _full_weights(module),
            "graph_breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"]}


def compiled_against_eager(cases: list[tuple[str, int]], backend: str, steps: int = 2) -> dict:
    """Each (api, stage) eager and compiled, on the same batches."""
    return {f"{api}/{stage}": {"eager": _train(api, stage, None, steps), "compiled": _train(api, stage, backend, steps)}
            for api, stage in cases}
