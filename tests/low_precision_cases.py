"""Rank-side runs and the single-process reference for test_low_precision.py.

A bf16 (or fp16) model with DeepSpeed's low-precision master keys, 2 ranks, 4 micro-batches per step.
The reference repeats the engine's arithmetic in one process (zero/low_precision.py): each rank's
micro-batch forward/backward in the compute dtype, the gradients summed in that dtype in the order the
stage sums them, the mean over ranks in that dtype, then per parameter the fp32 window: master (+ Kahan
compensation) upcast, torch's fused AdamW on it with the state upcast from its kept dtype, the window
rounded back to the master (the compensation keeping what rounding lost) and the state rounded to its
kept dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from grad_accum_cases import GAS, MICRO, SEQ, STEPS, accum_config, micro_grads, summed_grads
from tiny_models import batches, build
from zero_cases import BETAS, EPS, LR, WD, run_micro_batches

import shardwise
from shardwise.zero import GatheredParameters

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def lowp_config(stage: int, mode: str, update: str = "kahan", precision: str = "bf16", **extra) -> dict:
    """``mode``: "fp32" (the default masters), "master" (master and grads low, states fp32) or "states"
    (bf16 master, grads and states)."""
    cfg = accum_config(stage, None, precision=precision, **extra)
    if precision == "fp16":
        cfg["fp16"]["initial_scale_power"] = 0  # a loss scale of 1: the reference need not scale
    if mode != "fp32":
        cfg[precision][f"{precision}_master_weights_and_grads"] = True
        if mode == "states":
            cfg["bf16"]["bf16_optimizer_states"] = True
        cfg["shardwise"] = {"master_update": update}
    return cfg


def train_ranks(config: dict, steps: int = STEPS) -> dict:
    """Train on this rank's slice; rank 0 returns the weights (the masters: they are the parameters)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("llama")
    data = batches(steps, GAS, MICRO * world, SEQ)
    engine, *_ = shardwise.initialize(model=model, config=config)
    losses = run_micro_batches(engine, data, rank, MICRO)
    with GatheredParameters(model.parameters()):  # a no-op below stage 3
        weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    g = engine.groups[0]
    states = sorted({str(v.dtype) for st in engine.optimizer.state.values() for v in st.values()
                     if torch.is_tensor(v) and v.dim() == 1})
    result = {"losses": losses, "memory": engine.memory_report(), "master_dtype": str(g.master.dtype),
              "master_is_view": g.master_is_view, "state_dtypes": states,
              "numel": sum(p.numel() for p in model.parameters()),
              "accessors": [engine.bf16_master_weights_and_gradients(), engine.bf16_optimizer_states(),
                            engine.fp16_master_weights_and_gradients()]}
    if rank == 0:
        result["weights"] = weights
    return result


def refusal(config: dict, optimizer: str) -> str:
    """The one-line error of ``initialize`` with the config's optimizer replaced by ``optimizer``."""
    config = {**config, "optimizer": {"type": optimizer, "params": {"lr": LR}}}
    try:
        shardwise.initialize(model=build("llama"), config=config)
    except ValueError as exc:
        return str(exc)
    return "no error"


def reference(precision: str, mode: str, update: str, order: str, world: int = 2, steps: int = STEPS) -> dict:
    """The engine's arithmetic in one process (see the module docstring); ``order`` as in grad_accum_cases."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (tests/rank_pool.py)
    try:
        return _reference(DTYPES[precision], mode, update, order, world, steps)
    finally:
        torch.set_num_threads(threads)


class WindowAdamW:
    """Plain torch AdamW (fused, as the engine picks on CPU and CUDA) over fp32 windows of low-precision
    parameters: the arithmetic zero/low_precision.py promises, written per parameter."""

    def __init__(self, params: list[torch.Tensor], state_dtype: torch.dtype, update: str):
        self.params, self.state_dtype, self.update = params, state_dtype, update
        self.windows = [torch.zeros(p.numel()) for p in params]
        self.comp = [torch.zeros(p.numel()) for p in params]
        self.opt = torch.optim.AdamW(self.windows, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        for p, w, c, g in zip(self.params, self.windows, self.comp, grads, strict=True):
            w.copy_(p.reshape(-1).float() + c if self.update == "kahan" else p.reshape(-1).float())
            w.grad = g.reshape(-1).float()
        self.opt.step()
        for p, w, c in zip(self.params, self.windows, self.comp, strict=True):
            rounded = w.to(p.dtype)
            c.copy_((w - rounded.float()).to(p.dtype).float())  # kept in the master's dtype
            p.copy_(rounded.view(p.shape))
            for v in self.opt.state[w].values():
                if v.dim() == 1:
                    v.copy_(v.to(self.state_dtype).float())


def _reference(dtype: torch.dtype, mode: str, update: str, order: str, world: int, steps: int) -> dict:
    model = build("llama")
    for p in model.parameters():  # as the engine casts: parameters only, buffers stay fp32
        p.data = p.data.to(dtype)
    names, params = zip(*model.named_parameters(), strict=True)
    opt = WindowAdamW(list(params), dtype if mode == "states" else torch.float32, update)
    data = batches(steps, GAS, MICRO * world, SEQ)
    losses: dict[int, list[float]] = {r: [] for r in range(world)}
    for s in range(steps):
        grads = micro_grads(model, params, data[s], world, losses)
        opt.step([g.mul_(1.0 / world) for g in summed_grads(grads, dtype, order)])  # the mean in the master's dtype
    return {"losses": losses, "weights": {n: p.detach().float().clone() for n, p in zip(names, params, strict=True)}}


# -- checkpoints: every mode saves, reshards, resumes, and loads into the other modes ---------------------
def ckpt_config(stage: int, mode: str, update: str = "kahan") -> dict:
    """ckpt_cases' config (AdamW + warmup, 4 steps of a global batch of 4), bf16, with ``mode``'s keys."""
    from ckpt_cases import config

    cfg = config(stage, dist.get_world_size(), precision="bf16")
    if mode != "fp32":
        cfg["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=mode == "states")
        cfg["shardwise"] = {"master_update": update}
    return cfg


def _ckpt_steps(engine, start: int, stop: int) -> list[float]:
    from ckpt_cases import GLOBAL_MICRO, SEQ, STEPS

    rank, world = dist.get_rank(), dist.get_world_size()
    micro, data = GLOBAL_MICRO // world, batches(STEPS, 1, GLOBAL_MICRO, SEQ)
    losses = []
    for s in range(start, stop):
        ids = data[s, 0, rank * micro:(rank + 1) * micro]
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        losses.append(float(out.loss))
    return losses


def _weights(engine) -> dict:
    with GatheredParameters(engine.module.parameters()):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def ckpt_run(stage: int, mode: str, ckpt: str | None = None, load: str | None = None, update: str = "kahan",
             seed: int = 0) -> dict:
    """``load``: resume from that checkpoint first (a fresh engine of another seed); else train from step 0
    and save at the halfway step into ``ckpt``. Returns the losses, the weights at the save/load and at the end."""
    from ckpt_cases import STEPS

    engine, *_ = shardwise.initialize(model=build("llama", seed=seed), config=ckpt_config(stage, mode, update))
    half, at, comp = STEPS // 2, None, []
    if load is not None:
        engine.load_checkpoint(load)
        comp = [float(st["shardwise_compensation"].abs().max()) for st in engine.optimizer.state.values()
                if "shardwise_compensation" in st]
        at, losses = _weights(engine), _ckpt_steps(engine, engine.global_steps, STEPS)
    else:
        losses = _ckpt_steps(engine, 0, half)
        engine.save_checkpoint(ckpt)
        at = _weights(engine)
        losses += _ckpt_steps(engine, half, STEPS)
    end = _weights(engine)
    return {"losses": losses, "at": at if dist.get_rank() == 0 else None, "end": end if dist.get_rank() == 0 else None,
            "global_steps": engine.global_steps, "loaded_compensation": comp}
