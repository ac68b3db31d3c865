"""Rank-side runs and the single-process reference for test_grad_accum_dtype.py.

A bf16 model trained with ``gradient_accumulation_steps`` 4 over 2 ranks. The reference repeats the
engine's arithmetic in one process: each rank's micro-batch forward/backward in bf16, the bf16
gradients summed in the accumulation dtype (fp32 with ``data_types.grad_accum_dtype: "fp32"``, bf16
by default) in the order the stage sums them, the fp32 mean over ranks, fp32 AdamW on fp32 masters,
and the masters rounded to bf16 for the next forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tiny_models import batches, build
from zero_cases import BETAS, EPS, LR, WD, make_config, run_micro_batches

import shardwise
from shardwise.utils import safe_get_full_fp32_param, safe_get_full_grad
from shardwise.zero import GatheredParameters

STEPS, SEQ, GAS, MICRO = 3, 16, 4, 2


def accum_config(stage: int, accum: str | None, precision: str = "bf16", **extra) -> dict:
    """A config with 4 micro-batches per step; ``accum`` is ``data_types.grad_accum_dtype`` (None: unset)."""
    cfg = make_config(stage, precision=precision, micro=MICRO, gas=GAS, **extra)
    if accum is not None:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    return cfg


def train_ranks(config: dict, steps: int = STEPS) -> dict:
    """Train on this rank's slice of the global batches; rank 0 returns the fp32 masters and bf16 weights."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("llama")
    micro, gas = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    data = batches(steps, gas, micro * world, SEQ)
    engine, *_ = shardwise.initialize(model=model, config=config)
    losses = run_micro_batches(engine, data, rank, micro)
    masters = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}  # collective
    with GatheredParameters(model.parameters()):  # a no-op below stage 3
        weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    g = engine.groups[0]
    result = {"losses": losses, "grad_dtypes": sorted({str(g.grad_dtype) for g in engine.groups}),
              "grads_are_views": g.grads_are_views, "memory": engine.memory_report()}
    if rank == 0:
        result["masters"], result["weights"] = masters, weights
    return result


def grad_semantics(stage: int) -> dict:
    """What code reading gradients sees with fp32 accumulation: ``param.grad``, ``safe_get_full_grad``,
    the clipping norm, and ``no_sync`` (stages 0-1) for the first three micro-batches of a step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = accum_config(stage, "fp32", clip=1e-3)  # clipping active: the norm must be of the fp32 sum
    model = build("llama")
    data = batches(1, GAS, MICRO * world, SEQ)
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    for m in range(GAS):
        ids = data[0, m, rank * MICRO:(rank + 1) * MICRO]
        if stage < 2 and m < GAS - 1:
            with engine.no_sync():
                engine.backward(engine(input_ids=ids, labels=ids).loss)
        else:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
        if m < GAS - 1:
            engine.step()
    grads = {n: safe_get_full_grad(p) for n, p in model.named_parameters()}  # collective at stages >= 1
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
    param_grads = [p.grad for p in model.parameters()]
    engine.step()
    masters = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    return {"param_grads_none": all(g is None for g in param_grads),
            "grad_dtypes": sorted({str(g.dtype) for g in grads.values()}),
            "norm_from_grads": norm, "engine_norm": engine.last_grad_norm,
            "grads": grads if rank == 0 else None, "masters": masters if rank == 0 else None}


def first_step_grads(stage: int, accum: str | None) -> dict:
    """The gradient the masters receive at the first step (mean over ranks), read by safe_get_full_grad."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("llama")
    data = batches(1, GAS, MICRO * world, SEQ)
    engine, *_ = shardwise.initialize(model=model, config=accum_config(stage, accum))
    for m in range(GAS):
        ids = data[0, m, rank * MICRO:(rank + 1) * MICRO]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        if m < GAS - 1:
            engine.step()
    grads = {n: safe_get_full_grad(p) for n, p in model.named_parameters()}  # collective at stages >= 1
    return {"grads": grads if rank == 0 else None}


# -- the single-process reference -------------------------------------------------------------------
def reference(accum: torch.dtype, order: str, world: int = 2, steps: int = STEPS,
              model_dtype: torch.dtype = torch.bfloat16) -> dict:
    """The engine's arithmetic in one process (see the module docstring).

    ``order`` is where the cross-rank sum happens: "rank" (stages 0-1: each rank sums its
    micro-batches, one reduction at the boundary) or "micro" (stages >= 2: each micro-batch is
    reduce-scattered and the reduced gradients are summed). The two agree in exact arithmetic;
    their distance is the round-off the equivalence bound is derived from (tests/tolerance.py).
    ``model_dtype`` fp32 (with fp32 ``accum``) is plain fp32 training, the target of both.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (tests/rank_pool.py): the same kernels' blocking
    try:
        return _reference(accum, order, world, steps, model_dtype)
    finally:
        torch.set_num_threads(threads)


def _reference(accum: torch.dtype, order: str, world: int, steps: int, model_dtype: torch.dtype) -> dict:
    model = build("llama")
    for p in model.parameters():  # as the engine casts: parameters only, buffers stay fp32
        p.data = p.data.to(model_dtype)
    names, params = zip(*model.named_parameters(), strict=True)
    masters = [p.detach().float().clone() for p in params]
    opt = torch.optim.AdamW(masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    data = batches(steps, GAS, MICRO * world, SEQ)
    losses: dict[int, list[float]] = {r: [] for r in range(world)}
    for s in range(steps):
        grads = micro_grads(model, params, data[s], world, losses)
        for mp, g in zip(masters, summed_grads(grads, accum, order), strict=True):
            mp.grad = g.float().mul_(1.0 / world)
        if s == 0:
            first_grads = {n: mp.grad.clone().view(mp.shape) for n, mp in zip(names, masters, strict=True)}
        opt.step()
        with torch.no_grad():
            for p, mp in zip(params, masters, strict=True):
                p.copy_(mp)
    return {"losses": losses, "first_grads": first_grads,
            "masters": {n: mp.detach().clone() for n, mp in zip(names, masters, strict=True)},
            "weights": {n: p.detach().float().clone() for n, p in zip(names, params, strict=True)}}


def micro_grads(model, params, step_data: torch.Tensor, world: int, losses: dict[int, list[float]]) -> list:
    """One step of the references: ``grads[m][r]``, every parameter's gradient of micro-batch m on rank r
    (each backward alone, scaled by 1/GAS), and each micro-batch's loss appended to ``losses[r]``."""
    grads = [[None] * world for _ in range(GAS)]
    for m in range(GAS):
        for r in range(world):
            ids = step_data[m, r * MICRO:(r + 1) * MICRO]
            loss = model(input_ids=ids, labels=ids).loss
            (loss * (1.0 / GAS)).backward()
            grads[m][r] = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            model.zero_grad(set_to_none=True)
            losses[r].append(float(loss.detach()))
    return grads


def _acc(xs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Sum in ``dtype`` in list order, starting from zeros (what an in-place accumulating buffer does)."""
    out = torch.zeros(xs[0].shape, dtype=dtype)
    for x in xs:
        out.add_(x)
    return out


def summed_grads(grads: list[list[list[torch.Tensor]]], dtype: torch.dtype, order: str) -> list[torch.Tensor]:
    """The step's summed gradient of every parameter (``grads[m][r][i]``), in ``dtype``, in ``order``."""
    gas, world, n = len(grads), len(grads[0]), len(grads[0][0])
    out = []
    for i in range(n):
        if order == "rank":
            per_rank = [_acc([grads[m][r][i] for m in range(gas)], dtype) for r in range(world)]
            out.append(_acc(per_rank, dtype))
        else:
            per_micro = [_acc([grads[m][r][i].to(dtype) for r in range(world)], dtype) for m in range(gas)]
            out.append(_acc(per_micro, dtype))
    return out
