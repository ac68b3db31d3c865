"""Rank-side cases for test_ds_conformance.py (behaviours found by running DeepSpeed's unit tests)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from ds_api_cases import LR, config, data, mine, model, reference, train, weight_diff

import shardwise as deepspeed
from shardwise.zero import GatheredParameters, unwrap_model_for_generation


def read_only_edit(stage: int, editor: int) -> dict:
    """An in-place edit inside GatheredParameters(modifier_rank=None) raises on every rank and
    the weights stay what they were (the edit is not half-applied)."""
    m, ref = model(), model()
    engine, *_ = deepspeed.initialize(model=m, config=config(stage))
    w = m.l1.weight
    error = None
    try:
        with GatheredParameters([w, m.l2.weight]):
            if dist.get_rank() == editor:
                with torch.no_grad():
                    w.add_(1.0)
    except RuntimeError as e:
        error = str(e)
    with GatheredParameters([w]):
        diff = float((w.detach() - ref.l1.weight.detach()).abs().max())
    with GatheredParameters([w], modifier_rank=0):  # a read that edits nothing raises nothing
        if dist.get_rank() == 0:
            with torch.no_grad():
                w.mul_(1.0)
    with GatheredParameters([w]):
        clean = float(w.detach().sum())
    return {"error": error, "diff": diff, "clean": clean}


def unwrap_for_generation(stage: int) -> dict:
    """Inside the block every parameter is whole and a forward equals the plain model's; after it,
    training goes on exactly as plain torch trains."""
    m, ref = model(), model()
    engine, *_ = deepspeed.initialize(model=m, config=config(stage))
    x, y = data(1, seed=7)
    with unwrap_model_for_generation(engine) as unwrapped:
        whole = all(p.numel() == q.numel() and torch.equal(p.detach(), q.detach())
                    for p, q in zip(m.parameters(), ref.parameters(), strict=True))
        fwd = [float((unwrapped(mine(x[0]), mine(y[0])) - ref(mine(x[0]), mine(y[0]))).abs()) for _ in range(2)]
    train(engine, 3)
    reference(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01), 3)
    return {"whole": whole, "forward_diff": max(fwd), "after_diff": weight_diff(engine, ref)}


def vectorized_grad_update(stage: int) -> float:
    """safe_update_full_grad_vectorized(params, f) before step() trains as plain torch does with
    every gradient replaced by f(grad); returns the largest weight difference after 2 steps."""
    from shardwise.utils import safe_update_full_grad_vectorized

    m, ref = model(), model()
    engine, *_ = deepspeed.initialize(model=m, config=config(stage))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    xs, ys = data(2)
    for s in range(2):
        engine.backward(engine(mine(xs[s]), mine(ys[s])))
        safe_update_full_grad_vectorized(list(m.parameters()), lambda g, p: g + 0.01 * p.numel() ** 0.5)
        engine.step()
        opt.zero_grad()
        ref(xs[s], ys[s]).backward()
        for p in ref.parameters():
            p.grad += 0.01 * p.numel() ** 0.5
        opt.step()
    return weight_diff(engine, ref)


def scalar_all_gather_into_tensor() -> list[int]:
    """deepspeed.comm.all_gather_into_tensor of one 0-dim flag per rank (DeepSpeed's tests do this)."""
    flag = torch.tensor(dist.get_rank() + 1, dtype=torch.int)
    out = torch.zeros(dist.get_world_size(), dtype=torch.int)
    deepspeed.comm.all_gather_into_tensor(out, flag)
    return out.tolist()


class Tied(torch.nn.Module):
    """DeepSpeed's shared-weights checkpoint test shape: one Parameter under two names."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 6)
        self.a.weight = self.b.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.b(self.a(x)) ** 2).mean()


def save_tied(stage: int, folder: str) -> dict:
    """Train one step and save; returns the full fp32 values every name should hold."""
    from shardwise.utils import safe_get_full_fp32_param

    torch.manual_seed(0)
    m = Tied()
    engine, *_ = deepspeed.initialize(model=m, config=config(stage))
    engine.backward(engine(torch.randn(2, 6)))
    engine.step()
    engine.save_checkpoint(folder, tag="t")
    return {n: safe_get_full_fp32_param(p) for n, p in m.named_parameters(remove_duplicate=False)}


def frozen_getters(stage: int) -> dict:
    """DeepSpeed's safe_get_* answer None for a frozen parameter (no fp32 master, gradient or
    state); the trained ones still answer with their values."""
    from shardwise import utils as u

    m = model()
    m.l1.weight.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=m, config=config(stage))
    train(engine, 1)
    got = [u.safe_get_full_fp32_param(m.l1.weight), u.safe_get_full_grad(m.l1.weight),
           u.safe_get_full_optimizer_state(m.l1.weight, "exp_avg"), u.safe_get_local_fp32_param(m.l1.weight),
           u.safe_get_local_grad(m.l1.weight), u.safe_get_local_optimizer_state(m.l1.weight, "exp_avg")]
    trained = [u.safe_get_full_fp32_param(m.l2.weight), u.safe_get_full_grad(m.l2.weight),
               u.safe_get_full_optimizer_state(m.l2.weight, "exp_avg")]
    return {"frozen_none": all(t is None for t in got), "trained_values": all(t is not None for t in trained)}


def read_only_edit_kept_or_noop(stage: int) -> dict:
    """Edits inside GatheredParameters(modifier_rank=None) that lose nothing raise nothing: a no-op
    edit at any stage, and (fp32, stages 0-2, where the optimizer's master is the parameter's own
    storage) the same edit on every rank. At stage 3 that edit would be dropped with the gathered
    buffer, so it still raises."""
    m, ref = model(), model()
    deepspeed.initialize(model=m, config=config(stage))
    w = m.l1.weight
    out: dict = {"noop_error": None, "same_edit_error": None}
    try:
        with GatheredParameters([w, m.l2.weight]), torch.no_grad():
            w.copy_(w.detach().clone())
            m.l2.weight.mul_(1.0)
    except RuntimeError as e:
        out["noop_error"] = str(e)
    try:
        with GatheredParameters([w]), torch.no_grad():
            w.add_(1.0)
    except RuntimeError as e:
        out["same_edit_error"] = str(e)
    with GatheredParameters([w]):
        out["diff"] = float((w.detach() - ref.l1.weight.detach()).mean())
    return out


def kept_after_block(stage: int) -> dict:
    """What a script keeps from a GatheredParameters block (``p.detach().cpu()``, which is a view on
    CPU, and ``state_dict()`` values) stays valid after the block released the parameters, and
    training afterwards is unaffected."""
    m, ref = model(), model()
    engine, *_ = deepspeed.initialize(model=m, config=config(stage), model_parameters=m.parameters())
    with GatheredParameters(list(m.parameters())):
        kept = {n: p.detach().cpu() for n, p in m.named_parameters()}
        sd = m.state_dict()
    same = all(torch.equal(kept[n], q.detach()) and torch.equal(sd[n], q.detach()) for n, q in ref.named_parameters())
    train(engine, 2)
    reference(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01), 2)
    return {"same": same, "after_diff": weight_diff(engine, ref)}
