"""Rank-side checkpoint runs (used by test_checkpoint.py): train, save, load into another layout."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from tiny_models import batches, build
from zero_cases import make_config

import shardwise
import shardwise.checkpoint.save as ckpt_save
from shardwise.tensor_parallel import ShardSpec, gather_state_dict
from shardwise.zero import GatheredParameters

GLOBAL_MICRO, SEQ, STEPS = 4, 16, 4  # global batch of 4 sequences: micro 2 at world 2, 1 at world 4


def config(stage: int, world: int, bucket: int = 20_000, precision: str = "fp32", offload: bool = False,
           tp: int = 1, **zero_extra) -> dict:
    """AdamW + a warmup scheduler, so a resume that drops scheduler or Adam state shows up."""
    dp = world // tp
    cfg = make_config(stage, micro=GLOBAL_MICRO // dp, dp=dp, bucket=bucket, precision=precision,
                      offload=offload, tp=tp, **zero_extra)
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
    tp = engine.tp.size
    rank, world = dist.get_rank() // tp, dist.get_world_size() // tp  # TP groups: consecutive ranks
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
        if engine.tp.size > 1:  # full HF tensors from the TP pieces (collective)
            weights = {n: t.float() for n, t in gather_state_dict(engine.module, engine.tp).items()}
        else:
            weights = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
        if dist.get_rank() == 0:
            res["weights"] = weights
    return res


def _model(kind: str, seed: int = 0, freeze: str | None = None) -> torch.nn.Module:
    """``freeze``: parameters whose name contains it are frozen (saved in the "frozen" section)."""
    model = build(kind, seed=seed)
    for n, p in model.named_parameters():
        if freeze and freeze in n:
            p.requires_grad_(False)
    return model


def train_and_save(kind: str, stage: int, ckpt: str, hf16: str, freeze: str | None = None, **cfg_kw) -> dict:
    """The uninterrupted run: STEPS steps, saving (and exporting HF weights) halfway."""
    engine, *_ = shardwise.initialize(model=_model(kind, freeze=freeze),
                                      config=config(stage, dist.get_world_size(), **cfg_kw))
    assert engine.tp.size == cfg_kw.get("tp", 1)
    half = STEPS // 2
    losses = _train(engine, 0, half)
    engine.save_checkpoint(ckpt, client_state={"epoch": 3, "note": "halfway", "seen": [1, 2]})
    engine.save_16bit_model(hf16)
    logits = _logits(engine.module)
    losses += _train(engine, half, STEPS)
    return _result(engine, losses, {"logits_at_save": logits})


def load_and_train(kind: str, stage: int, ckpt: str, bucket: int = 20_000, cfg_kw: dict | None = None,
                   save_to: str | None = None, freeze: str | None = None, **load_kw) -> dict:
    """A fresh engine (another seed: loading must overwrite everything) resumes from ``ckpt``."""
    world = dist.get_world_size()
    cfg = config(stage, world, bucket, **(cfg_kw or {}))
    engine, *_ = shardwise.initialize(model=_model(kind, seed=123, freeze=freeze), config=cfg)
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


def tp_pieces(full: torch.Tensor, dim: int, size: int, parts: int = 1) -> tuple[dict, dict]:
    """Metadata entries and local tensors of ``full`` saved at TP degree ``size`` (no ranks needed)."""
    from shardwise.checkpoint.tp import saved_name, tp_meta

    entries, locals_ = {}, {}
    for r in range(size):
        spec = ShardSpec(dim, full.shape[dim], size, r, parts)
        local = spec.take(full)
        key = saved_name("w", spec)
        entries[key] = {"shape": list(local.shape), "numel": local.numel(), "dtype": "float32",
                        "tp": tp_meta("w", spec, list(local.shape))}
        locals_[key] = local.reshape(-1)
    return entries, locals_


# -- hostile checkpoints (test_checkpoint_hostile.py, test_checkpoint_fuzz.py) ------------------------
def world1_group() -> bool:
    """A 1-rank gloo group in this process (no env vars, no port); True when this call created it."""
    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def small_engine(seed: int = 0, model: torch.nn.Module | None = None, stage: int = 2):
    engine, *_ = shardwise.initialize(model=model or build(KIND_SMALL, seed=seed),
                                      config=config(stage, dist.get_world_size()))
    return engine


KIND_SMALL = "llama"


def snapshot(engine) -> dict:
    """Every piece of engine state a load may touch, copied (tensors cloned)."""
    engine.wait_for_params()  # stage 1-2: the last step's parameter all-gather may still be running
    # keyed by the parameter's place in param_groups (as state_dict() does), not by the order the
    # optimizer happened to create its state in (per-bucket stepping creates it bucket by bucket)
    params = [p for pg in engine.optimizer.param_groups for p in pg["params"]]
    opt = {f"{i}/{k}": v.detach().clone() if torch.is_tensor(v) else v
           for i, p in enumerate(params) for k, v in engine.optimizer.state.get(p, {}).items()}
    return {"params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
            "masters": [g.master.detach().clone() for g in engine.groups],
            "opt_state": opt,
            "param_groups": [{k: v for k, v in pg.items() if k != "params"} for pg in engine.optimizer.param_groups],
            "sched": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
            "counters": (engine.global_steps, engine.micro_steps, engine.skipped_steps),
            "rng": torch.get_rng_state()}


def same_state(a: dict, b: dict) -> list[str]:
    """Names of the snapshot entries that differ (empty: identical, bit for bit)."""
    def eq(x, y) -> bool:
        if torch.is_tensor(x) or torch.is_tensor(y):
            return torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, list | tuple):
            return isinstance(y, list | tuple) and len(x) == len(y) and all(map(eq, x, y))
        return x == y
    return [k for k in a if not eq(a[k], b[k])]


def failed_load_leaves_engine(ckpt: str) -> dict:
    """Rank-side: a trained engine loads a checkpoint that only some rank finds damaged."""
    engine = small_engine(seed=3)
    _train(engine, 0, 1)
    before = snapshot(engine)
    try:
        engine.load_checkpoint(ckpt)
        msg = "no error"
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {e}"
    return {"msg": msg, "changed": same_state(before, snapshot(engine))}
