"""Optimizer construction and DeepSpeed-formula LR schedulers."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.optim.optimizers import build_optimizer, rebuild_client_optimizer
from shardwise.optim.schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler

# schedulers are stepped here without optimizer steps; torch warns about the order
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")


def _opt(lrs: tuple[float, ...] = (0.1,)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.zeros(2, requires_grad=True)], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def _lrs_along(sched, opt, iterations: list[int]) -> dict[int, list[float]]:
    """Step the scheduler from -1 and record the optimizer's lrs at the requested iterations."""
    out = {}
    for it in range(-1, max(iterations) + 1):
        if it >= 0:
            sched.step()
        assert sched.last_batch_iteration == it
        if it in iterations:
            out[it] = [g["lr"] for g in opt.param_groups]
            assert sched.get_last_lr() == out[it]
    return out


def _warm(it: int, w: int, kind: str) -> float:
    w = max(2, w)
    return math.log(it + 1) / math.log(w) if kind == "log" else it / w


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind: str) -> None:
    lo, hi, w = 1e-5, 2e-3, 10
    opt = _opt()
    sched = WarmupLR(opt, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=w, warmup_type=kind)
    its = [-1, 0, 1, 5, 9, 10, 25]
    got = _lrs_along(sched, opt, its)
    for it in its:
        gamma = 0.0 if it < 0 else (_warm(it, w, kind) if it < w else 1.0)
        assert got[it][0] == pytest.approx(lo + (hi - lo) * gamma, rel=1e-12, abs=0), it
    assert got[-1] == [lo] and got[25] == [hi]


def test_warmup_lr_per_group_lists_and_clamp() -> None:
    opt = _opt((0.5, 0.5))
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=0.2, warmup_num_steps=1)
    assert sched.warmup_num_steps == 2  # clamped like DeepSpeed
    sched.step()
    sched.step()  # iteration 1: log(2)/log(2) = 1
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.2, 0.2])
    with pytest.raises(ValueError, match="warmup_min_lr"):
        WarmupLR(_opt((0.1, 0.1)), warmup_min_lr=[0.0, 0.1, 0.2])
    with pytest.raises(ValueError, match="warmup_type"):
        WarmupLR(_opt(), warmup_type="cosine")


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr(kind: str) -> None:
    lo, hi, w, total = 0.0, 1e-3, 8, 40
    opt = _opt()
    sched = WarmupDecayLR(
        opt, total_num_steps=total, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=w, warmup_type=kind
    )
    its = [-1, 0, 3, 7, 8, 20, 39, 40, 55]
    got = _lrs_along(sched, opt, its)
    for it in its:
        if it < 0:
            gamma = 0.0
        elif it < w:
            gamma = _warm(it, w, kind)
        else:
            gamma = max(0.0, (total - it) / max(1, total - w))
        assert got[it][0] == pytest.approx(lo + (hi - lo) * gamma, rel=1e-12, abs=1e-18), it
    assert got[8][0] == pytest.approx(hi) and got[40][0] == 0.0 and got[55][0] == 0.0


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr(kind: str) -> None:
    base, w, total, r0, cmin = (0.1, 0.02), 10, 50, 0.05, 1e-3
    opt = _opt(base)
    sched = WarmupCosineLR(
        opt,
        total_num_steps=total,
        warmup_min_ratio=r0,
        warmup_num_steps=w,
        cos_min_ratio=cmin,
        warmup_type=kind,
    )
    its = [-1, 0, 4, 9, 10, 30, 49, 50, 70]
    got = _lrs_along(sched, opt, its)
    for it in its:
        if it < 0:
            ratio = 0.0
        elif it < w:
            ratio = r0 + (1 - r0) * _warm(it, w, kind)
        else:
            prog = (it - w + 1) / (total - w)  # DeepSpeed's "+ 1"
            ratio = max(0.0, cmin + (1 - cmin) * 0.5 * (1 + math.cos(math.pi * prog)))
        assert got[it] == pytest.approx([b * ratio for b in base], rel=1e-12, abs=1e-18), it
    assert got[49][0] == pytest.approx(base[0] * cmin)  # minimum one step before total
    assert got[70][0] > got[50][0]  # no clamp past total, as in DeepSpeed


def test_jump_and_state_dict_round_trip() -> None:
    def make():
        opt = _opt((0.1, 0.3))
        return opt, WarmupCosineLR(opt, total_num_steps=30, warmup_num_steps=5, warmup_type="linear")

    opt_a, a = make()
    for _ in range(7):
        a.step()
    sd = a.state_dict()
    assert sd["last_batch_iteration"] == 6

    opt_b, b = make()
    b.load_state_dict(sd)
    assert b.last_batch_iteration == 6 and b.get_last_lr() == a.get_last_lr()
    assert [g["lr"] for g in opt_b.param_groups] == [g["lr"] for g in opt_a.param_groups]
    a.step()
    b.step()
    assert b.get_last_lr() == a.get_last_lr()

    opt_c, c = make()  # DeepSpeed's own checkpoint format
    c.load_state_dict({"last_batch_iteration": 7})
    assert c.get_last_lr() == a.get_last_lr()

    opt_d, d = make()
    d.step(7)  # DeepSpeed's step(last_batch_iteration)
    assert d.last_batch_iteration == 7 and d.get_last_lr() == a.get_last_lr()
    d.step()
    assert d.get_last_lr() == c.lr_at(8)


def test_first_optimizer_step_uses_iteration_minus_one() -> None:
    opt = _opt()
    sched = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=4, warmup_type="linear")
    assert opt.param_groups[0]["lr"] == 0.01  # lr of iteration -1, before any step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.01  # iteration 0: gamma 0
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 + 0.09 / 4)


def test_build_scheduler() -> None:
    opt = _opt()
    s = build_scheduler("warmupdecaylr", {"total_num_steps": 10, "warmup_num_steps": 2}, opt)
    assert isinstance(s, WarmupDecayLR) and s.total_num_steps == 10
    with pytest.raises(ValueError, match=r"scheduler\.type.*'OneCycle'.*WarmupCosineLR"):
        build_scheduler("OneCycle", {}, opt)
    with pytest.raises(ValueError, match=r"scheduler\.params\.warmup_steps"):
        build_scheduler("WarmupLR", {"warmup_steps": 3}, opt)


def _groups() -> list[dict]:
    return [
        {"params": [torch.zeros(3, requires_grad=True)]},
        {"params": [torch.zeros(2)], "weight_decay": 0.0},
    ]


def test_build_optimizer_adam_semantics() -> None:
    o = build_optimizer("Adam", {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6}, _groups())
    assert type(o) is torch.optim.AdamW  # DeepSpeed: adam_w_mode defaults to true
    g = o.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (3e-4, (0.8, 0.95), 1e-6, 0.0)
    assert g["fused"] is True  # faster on CPU, see optim/optimizers.py _kernel_kwargs

    o = build_optimizer("adam", {"lr": 1e-3, "adam_w_mode": False, "weight_decay": 0.1}, _groups())
    assert type(o) is torch.optim.Adam and o.param_groups[0]["weight_decay"] == 0.1
    assert o.param_groups[1]["weight_decay"] == 0.0  # per-group override kept

    o = build_optimizer("ADAMW", {"lr": 1e-3, "adam_w_mode": False}, _groups())
    assert type(o) is torch.optim.AdamW  # AdamW is AdamW whatever adam_w_mode says

    o = build_optimizer("AdamW", {"lr": 1e-3, "torch_adam": True, "fused": False}, _groups())
    assert o.param_groups[0]["weight_decay"] == 0.01  # torch's default under torch_adam
    assert o.param_groups[0]["foreach"] is True and not o.param_groups[0]["fused"]


def test_build_optimizer_sgd_and_errors() -> None:
    o = build_optimizer("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "dampening": 0.0}, _groups())
    assert type(o) is torch.optim.SGD
    g = o.param_groups[0]
    assert (g["lr"], g["momentum"], g["nesterov"], g["dampening"]) == (0.1, 0.9, True, 0.0)
    with pytest.raises(ValueError, match=r"optimizer\.type 'OneBitLamb'.*Adam, AdamW, SGD, Lamb, Muon"):
        build_optimizer("OneBitLamb", {}, _groups())
    with pytest.raises(ValueError, match=r"optimizer\.params\.max_grad_norm"):
        build_optimizer("Adam", {"max_grad_norm": 1.0}, _groups())


def _client(cls=torch.optim.AdamW, **kw) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    torch.manual_seed(0)
    w, b, e = (
        torch.randn(4, 3, requires_grad=True),
        torch.randn(3, requires_grad=True),
        torch.randn(5, 2, requires_grad=True),
    )
    opt = cls(
        [{"params": [w, e], "weight_decay": 0.1, "lr": 1e-2}, {"params": [b], "weight_decay": 0.0}],
        lr=3e-3,
        **kw,
    )
    return opt, [w, e, b]


def test_rebuild_keeps_per_group_hyperparameters() -> None:
    client, params = _client(betas=(0.8, 0.9))
    before = [{k: v for k, v in g.items() if k != "params"} for g in client.param_groups]
    new = rebuild_client_optimizer(client, [[torch.zeros(20)], [torch.zeros(3)]])
    assert new is client and type(new) is torch.optim.AdamW  # DeepSpeed keeps the client object
    assert before == [{k: v for k, v in g.items() if k != "params"} for g in new.param_groups]
    assert new.param_groups[0]["weight_decay"] == 0.1 and new.param_groups[1]["weight_decay"] == 0.0
    assert new.param_groups[0]["lr"] == 1e-2 and new.param_groups[1]["lr"] == 3e-3
    with pytest.raises(ValueError, match="2 param groups"):
        rebuild_client_optimizer(client, [[torch.zeros(3)]])

    made = rebuild_client_optimizer(lambda groups: torch.optim.SGD(groups, lr=0.5), [[torch.zeros(2)]])
    assert type(made) is torch.optim.SGD and made.param_groups[0]["lr"] == 0.5


def test_rebuild_refuses_stepped_optimizer() -> None:
    client, params = _client()
    for p in params:
        p.grad = torch.ones_like(p)
    client.step()
    with pytest.raises(ValueError, match="fresh"):
        rebuild_client_optimizer(client, [[torch.zeros(20)], [torch.zeros(3)]])


@pytest.mark.parametrize("kw", [{}, {"fused": True}, {"foreach": True}], ids=["default", "fused", "foreach"])
def test_rebuilt_step_on_flat_views_is_bit_exact(kw: dict) -> None:
    client, params = _client(**kw)
    ref = [p.detach().clone() for p in params]
    flat = torch.cat([p.detach().reshape(-1) for p in params])  # the engine's flat master buffer
    flat_grad = torch.empty_like(flat)
    views, offset = [], 0
    for p in params:
        v = flat[offset : offset + p.numel()]
        v.grad = flat_grad[offset : offset + p.numel()]
        views.append(v)
        offset += p.numel()
    assert all(v.is_leaf for v in views)
    twin, _ = _client(**kw)  # the same hyperparameters; re-pointed in place at the flat views
    new = rebuild_client_optimizer(twin, [[views[0], views[1]], [views[2]]])
    assert new is twin
    for step in range(3):
        for p, v in zip(params, views, strict=True):
            g = torch.randn_like(p) * (step + 1)
            p.grad = g
            v.grad.copy_(g.reshape(-1))
        client.step()
        new.step()
    for p, v, r in zip(params, views, ref, strict=True):
        assert not torch.equal(p.detach(), r)
        assert torch.equal(p.detach().reshape(-1), v)
