"""Rank-side checkpoint runs (used by test_checkpoint.py): train, save, load into another layout."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from tiny_models import batches, build
from zero_cases import make_config

import shardwise
import shardwise.checkpoint.save as ckpt_save
from shardwise.zero import GatheredParameters

GLOBAL_MICRO, SEQ, STEPS = 4, 16, 4  # global batch of 4 sequences: micro 2 at world 2, 1 at world 4


def config(stage: int, world: int, bucket: int = 20_000, precision: str = "fp32", offload: bool = False) -> dict:
    """AdamW + a warmup scheduler, so a resume that drops scheduler or Adam state shows up."""
    cfg = make_config(stage, micro=GLOBAL_MICRO // world, dp=world, bucket=bucket, precision=precision,
                      offload=offload)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3,
                                                        "warmup_num_steps": 6, "warmup_type": "linear"}}
    return cfg


def probe_ids() -> torch.Tensor:
    return batches(1, 1, 2, SEQ, seed=7)[0, 0]


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=probe_ids()).logits.detach().clone()


def _train(engine, start: int, stop: int) -> list[float]:
    """Global steps [start, stop) on this rank's slice of the shared global batches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = GLOBAL_MICRO // world
    data = batches(STEPS, 1, GLOBAL_MICRO, SEQ)
    losses = []
    for s in range(start, stop):
        ids = data[s, 0, rank * micro:(rank + 1) * micro]
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss))
    return losses


def _result(engine, losses: list[float], extra: dict | None = None) -> dict:
    res = {"losses": losses, "global_steps": engine.global_steps, "lr": engine.get_lr()[0], **(extra or {})}
    with GatheredParameters(engine.module.parameters()):  # stage 3: full values for a moment
        if dist.get_rank() == 0:
            res["weights"] = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return res


def train_and_save(kind: str, stage: int, ckpt: str, hf16: str, **cfg_kw) -> dict:
    """The uninterrupted run: STEPS steps, saving (and exporting HF weights) halfway."""
    engine, *_ = shardwise.initialize(model=build(kind), config=config(stage, dist.get_world_size(), **cfg_kw))
    half = STEPS // 2
    losses = _train(engine, 0, half)
    engine.save_checkpoint(ckpt, client_state={"epoch": 3, "note": "halfway", "seen": [1, 2]})
    engine.save_16bit_model(hf16)
    logits = _logits(engine.module)
    losses += _train(engine, half, STEPS)
    return _result(engine, losses, {"logits_at_save": logits})


def load_and_train(kind: str, stage: int, ckpt: str, bucket: int = 20_000, cfg_kw: dict | None = None,
                   save_to: str | None = None, **load_kw) -> dict:
    """A fresh engine (another seed: loading must overwrite everything) resumes from ``ckpt``."""
    world = dist.get_world_size()
    cfg = config(stage, world, bucket, **(cfg_kw or {}))
    engine, *_ = shardwise.initialize(model=build(kind, seed=123), config=cfg)
    path, client = engine.load_checkpoint(ckpt, **load_kw)
    start = engine.global_steps
    losses = _train(engine, start, STEPS)
    if save_to is not None:
        engine.save_checkpoint(save_to)
    return _result(engine, losses, {"path": path, "client_state": client, "start": start})


def load_error(kind: str, ckpt: str) -> str:
    """Load a damaged checkpoint; return the error message (every rank must fail, none hang)."""
    engine, *_ = shardwise.initialize(model=build(kind), config=config(2, dist.get_world_size()))
    try:
        engine.load_checkpoint(ckpt)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def crash_during_save(kind: str, ckpt: str) -> dict:
    """Save tag 'good', then a save whose rank 0 dies after writing its shard file; load again."""
    engine, *_ = shardwise.initialize(model=build(kind), config=config(2, dist.get_world_size()))
    _train(engine, 0, 1)
    engine.save_checkpoint(ckpt, tag="good")
    good = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    _train(engine, 1, 2)
    out: dict = {}

    def die(path: Path) -> None:
        if dist.get_rank() == 0:
            raise OSError(f"simulated crash after writing {path.name}")

    ckpt_save._after_file_written, orig = die, ckpt_save._after_file_written
    try:
        engine.save_checkpoint(ckpt, tag="bad")
        out["save"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["save"] = f"{type(e).__name__}: {e}"
    finally:
        ckpt_save._after_file_written = orig
    try:
        engine.save_checkpoint(ckpt, tag="x", client_state={"bad": object()})
        out["client_state"] = "no error"
    except TypeError as e:
        out["client_state"] = str(e)
    path, _ = engine.load_checkpoint(ckpt)
    out["path"] = path
    out["restored"] = all(torch.equal(p, good[n]) for n, p in engine.module.named_parameters())
    out["global_steps"] = engine.global_steps
    return out
