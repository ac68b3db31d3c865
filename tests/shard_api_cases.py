"""Rank-side runs of the functional API (``shardwise.shard`` + a plain PyTorch loop), for test_shard_api.py."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tiny_models import batches, build
from zero_cases import BETAS, EPS, LR, WD, make_config

import shardwise
from shardwise.layout import get_mesh
from shardwise.tensor_parallel import apply_tensor_parallel


def _adamw(model) -> shardwise.ShardedOptimizer:
    return shardwise.ShardedOptimizer(model, torch.optim.AdamW, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


def _weights(model) -> dict[str, torch.Tensor]:
    """Full parameters by name on rank 0 (full_state_dict gathers ZeRO shards and TP slices)."""
    sd = shardwise.full_state_dict(model)
    names = [n for n, _ in model.named_parameters()]
    return {n: sd[n].float() for n in names} if sd else {}


def train_plain_loop(kind: str, stage: int, gas: int = 1, clip: float = 0.0, precision: str | None = None,
                     offload: str | None = None, shard_size: int | None = None, tp: int = 1, steps: int = 3,
                     micro: int = 2, seq: int = 16, unused: bool = False, toggle: bool = True,
                     **shard_kw) -> dict:
    """The README loop on this rank's slice of the global batches the reference sees.

    ``toggle``: accumulate with ``set_requires_gradient_sync`` (False: never call it, so every
    backward reduces, the loop DDP and FSDP2 users write first).

    ``unused``: a layer gets a parameter the forward never uses, in the bucket of used ones: only the
    end-of-backward callback reduces (and at stage 3 releases) that bucket, since its last gradient
    never arrives.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(kind)
    if unused:
        model.model.layers[0].mlp.extra = torch.nn.Linear(4, 4)
    mesh = None
    if tp > 1:
        mesh = get_mesh(tp, shard_size)
        apply_tensor_parallel(model, mesh.tp)  # TP first (every rank holds the same seed-0 weights)
        shard_size = None
    model = shardwise.shard(model, stage=stage, mesh=mesh, shard_size=shard_size, mixed_precision=precision,
                            offload=offload, bucket_size=20_000, **shard_kw)
    opt = _adamw(model)
    dp_world, dp_rank = world // tp, rank // tp  # TP groups are consecutive ranks
    data = batches(steps, gas, micro * dp_world, seq)
    losses, norms, comm_in_no_sync = [], [], []
    stats = model.sharding.comm.stats
    for s in range(steps):
        for m in range(gas):
            ids = data[s, m, dp_rank * micro:(dp_rank + 1) * micro]
            last = m == gas - 1
            if toggle:
                model.set_requires_gradient_sync(last)
            before = sum(stats.as_dict().values())
            loss = model(input_ids=ids, labels=ids).loss
            (loss / gas).backward()
            if not last:
                comm_in_no_sync.append(sum(stats.as_dict().values()) - before)
            losses.append(float(loss.detach()))
        sh = model.sharding  # after a plain backward: every group reduced, stage-3 groups released
        unfinished = [g for g in sh.all_groups if (g.trainable and g._ready < len(g.params))
                      or (g.policy.shard_params and g.is_gathered)]
        if clip:
            norms.append(float(shardwise.clip_grad_norm_(model, clip)))
        opt.step()
        opt.zero_grad()
    weights = {n: w for n, w in _weights(model).items() if ".extra." not in n}
    return {"losses": losses, "weights": weights, "norms": norms, "comm_in_no_sync": comm_in_no_sync,
            "unfinished_groups": len(unfinished), "class": type(model).__name__,
            "replicas": model.sharding.replica.size,
            "master_device": str(model.sharding.groups[0].master.device)}


def _functional(kind: str, stage: int):
    model = shardwise.shard(build(kind), stage=stage, bucket_size=20_000)
    return model, _adamw(model)


def _engine(kind: str, stage: int):
    engine, *_ = shardwise.initialize(model=build(kind), config=make_config(stage))
    return engine


def _step(model, opt, ids: torch.Tensor) -> None:
    """One step of either front end."""
    if opt is None:  # the engine
        model.backward(model(input_ids=ids, labels=ids).loss)
        model.step()
    else:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def checkpoint_across_front_ends(kind: str, ckpt: str, saver: str) -> dict:
    """``saver`` ('functional' or 'engine', stage 2) trains 2 steps, saves and takes a third; the other
    front end (stage 3) loads and takes the same third step. Returns both third-step weights."""
    rank = dist.get_rank()
    data = batches(3, 1, 4, 16)
    ids = [data[s, 0, rank * 2:(rank + 1) * 2] for s in range(3)]
    if saver == "functional":
        model, opt = _functional(kind, 2)
        for s in range(2):
            _step(model, opt, ids[s])
        shardwise.save_checkpoint(ckpt, model, opt)
        saved = _weights(model)
        _step(model, opt, ids[2])
        first = _weights(model)
        engine = _engine(kind, 3)
        path, _ = engine.load_checkpoint(ckpt)
        loaded, steps = _weights(engine.module), engine.global_steps
        _step(engine, None, ids[2])
        second = _weights(engine.module)
    else:
        engine = _engine(kind, 2)
        for s in range(2):
            _step(engine, None, ids[s])
        engine.save_checkpoint(ckpt)
        saved = _weights_engine(engine)
        _step(engine, None, ids[2])
        first = _weights_engine(engine)
        model, opt = _functional(kind, 3)
        path, _ = shardwise.load_checkpoint(ckpt, model, opt)
        loaded, steps = _weights(model), opt.global_steps
        _step(model, opt, ids[2])
        second = _weights(model)
    return {"saved": saved, "loaded": loaded, "first": first, "second": second, "steps": steps,
            "path": path}


def _weights_engine(engine) -> dict[str, torch.Tensor]:
    with shardwise.GatheredParameters(list(engine.module.parameters())):
        w = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return w if dist.get_rank() == 0 else {}


def sharded_state_round_trip(kind: str, stage: int) -> dict:
    """sharded_state_dict, a step that changes the weights, load_sharded_state_dict: back to the saved ones;
    the same with full_state_dict / load_full_state_dict."""
    model, opt = _functional(kind, stage)
    ids = batches(1, 1, 4, 16)[0, 0, dist.get_rank() * 2:(dist.get_rank() + 1) * 2]
    _step(model, opt, ids)
    before = _weights(model)
    state = shardwise.sharded_state_dict(model)
    _step(model, opt, ids)
    moved = _weights(model)
    shardwise.load_sharded_state_dict(model, state)
    after = _weights(model)
    full = shardwise.full_state_dict(model)  # rank 0 only; the others pass {}
    _step(model, opt, ids)
    shardwise.load_full_state_dict(model, full)
    return {"before": before, "moved": moved, "after": after, "pieces": len(state),
            "after_full": _weights(model)}


def double_shard_refused(kind: str) -> str:
    model = shardwise.shard(build(kind), stage=2)
    try:
        shardwise.shard(model, stage=2)
    except ValueError as e:
        return str(e)
    return ""
