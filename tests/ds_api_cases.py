"""Rank-side cases for test_ds_api.py: DeepSpeed's public API as its scripts and tests call it.

Every numeric check compares with the same model trained in this process with plain torch on the
whole global batch (each rank computes that reference itself: the model is tiny).
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise as deepspeed
from shardwise.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
)

H, MICRO, LR = 8, 2, 1e-2


class SimpleModel(nn.Module):
    """DeepSpeed's unit-test model shape: linear layers and a cross-entropy loss from (x, y)."""

    def __init__(self, hidden: int = H, unused: bool = False):
        super().__init__()
        self.l1 = nn.Linear(hidden, hidden)
        self.l2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 4)
        self.spare = nn.Linear(hidden, hidden) if unused else None

    def forward_hidden_size(self) -> int:
        return self.l1.in_features

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(torch.relu(self.l2(torch.relu(self.l1(x))))), y)


def model(seed: int = 0, **kw) -> SimpleModel:
    torch.manual_seed(seed)
    return SimpleModel(**kw)


def data(steps: int, world: int = 2, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(steps, world * MICRO, H, generator=g), torch.randint(0, 4, (steps, world * MICRO), generator=g)


def config(stage: int, optimizer: bool = True, gas: int = 1, **zero) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "steps_per_print": 0,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}
    return cfg


def mine(t: torch.Tensor) -> torch.Tensor:
    r = dist.get_rank()
    return t[r * MICRO:(r + 1) * MICRO]


def train(engine, steps: int, seed: int = 1) -> list[float]:
    xs, ys = data(steps, seed=seed)
    dt = torch.float16 if engine.fp16_enabled() else torch.float32  # DeepSpeed scripts feed fp16 data
    losses = []
    for s in range(steps):
        loss = engine(mine(xs[s]).to(dt), mine(ys[s]))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def reference(m: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    xs, ys = data(steps, seed=seed)
    for s in range(steps):
        opt.zero_grad(set_to_none=False)
        m(xs[s], ys[s]).backward()
        opt.step()


def weight_diff(engine, ref: nn.Module) -> float:
    """Largest difference between the engine's fp32 weights and the reference's (collective)."""
    got = dict(engine.module.named_parameters())
    return max(float((safe_get_full_fp32_param(got[n]) - p.detach()).abs().max()) for n, p in ref.named_parameters())


# -- item 4 and 5: optimizer rules ----------------------------------------------------------
def generate_without_optimizer(stage: int) -> bool:
    """An evaluation engine of an HF model generates what the plain model generates."""
    from tiny_models import build

    plain = build("llama").eval()
    engine, opt, _, _ = deepspeed.initialize(model=build("llama").eval(), config=config(stage, optimizer=False))
    ids = torch.arange(1, 9).view(1, 8)
    want = plain.generate(ids, max_new_tokens=4, do_sample=False)
    return opt is None and torch.equal(engine.generate(ids, max_new_tokens=4, do_sample=False), want)


def no_optimizer(stage: int, ckpt: str) -> dict:
    m, plain = model(), model()
    engine, opt, _, sched = deepspeed.initialize(model=m, config=config(stage, optimizer=False))
    x, y = data(1)
    same = float((engine(x[0], y[0]) - plain(x[0], y[0])).abs())
    errors = []
    for call in (lambda: engine.backward(engine(x[0], y[0])), engine.step):
        try:
            call()
        except AssertionError as e:
            errors.append(str(e))
    engine.save_checkpoint(ckpt, tag="eval")
    other, _, _, _ = deepspeed.initialize(model=model(seed=5), config=config(stage, optimizer=False))
    before = float((other(x[0], y[0]) - plain(x[0], y[0])).abs())
    other.load_checkpoint(ckpt, tag="eval")
    after = float((other(x[0], y[0]) - plain(x[0], y[0])).abs())
    return {"opt": opt, "sched": sched, "forward_diff": same, "errors": errors, "before": before, "after": after}


def optimizer_rules(case: str, stage: int) -> dict:
    m, ref = model(), model()
    cfg = config(stage, optimizer=False)
    kw: dict = {}
    if case == "override":  # client optimizer and a config section: the client wins
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.5}}
        client = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.01)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    elif case == "empty_group":
        client = torch.optim.AdamW([{"params": list(m.parameters())}, {"params": []}], lr=LR)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    elif case == "callable":
        def split(mod: nn.Module) -> list[dict]:
            ws = [p for n, p in mod.named_parameters() if n.endswith("weight")]
            bs = [p for n, p in mod.named_parameters() if n.endswith("bias")]
            return [{"params": ws, "weight_decay": 0.1}, {"params": bs, "weight_decay": 0.0}]

        client = lambda groups: torch.optim.AdamW(groups, lr=LR)  # noqa: E731
        kw["model_parameters"] = split(m)
        ref_opt = torch.optim.AdamW(split(ref), lr=LR)
    else:
        raise ValueError(case)
    kw.setdefault("model_parameters", m.parameters())
    engine, opt, _, _ = deepspeed.initialize(model=m, config=cfg, optimizer=client, **kw)
    train(engine, 3)
    reference(ref, ref_opt, 3)
    return {"is_client": opt is client, "type": type(opt).__name__, "groups": len(opt.param_groups),
            "wd": [g["weight_decay"] for g in opt.param_groups], "diff": weight_diff(engine, ref),
            "engine_opt": opt is engine.optimizer}


def returned_optimizer_api(stage: int) -> dict:
    m = model()
    engine, opt, _, _ = deepspeed.initialize(model=m, config=config(stage), model_parameters=m.parameters())
    train(engine, 1)
    sd = opt.state_dict()
    for g in opt.param_groups:  # scripts change the lr through the returned optimizer
        g["lr"] = 0.0
    before = {n: safe_get_full_fp32_param(p) for n, p in m.named_parameters()}
    train(engine, 1, seed=2)
    moved = max(float((safe_get_full_fp32_param(p) - before[n]).abs().max()) for n, p in m.named_parameters())
    opt.zero_grad()
    try:
        opt.step()
        direct = "stepped"
    except AssertionError as e:
        direct = str(e)
    return {"direct_step": direct, "state_keys": sorted(sd), "n_state": len(sd["state"]), "moved": moved,
            "lr": engine.get_lr()}


def scheduler_on_other_optimizer() -> str:
    m = model()
    client = torch.optim.AdamW(m.parameters(), lr=LR)
    other = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW(m.parameters()), lambda e: 1.0)
    try:
        deepspeed.initialize(model=m, config=config(1, optimizer=False), optimizer=lambda g: client,
                             lr_scheduler=other)
    except AssertionError as e:
        return str(e)
    return "no error"


# -- item 6: arguments, accessors, comm, utils ------------------------------------------------
def args_config(tmp: str) -> dict:
    path = os.path.join(tmp, f"ds_{dist.get_rank()}.json")
    with open(path, "w") as f:
        json.dump(config(1), f)
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", path])
    m = model()
    engine, opt, _, _ = deepspeed.initialize(args, m, None, m.parameters())  # DeepSpeed's positional order
    out = {"stage": engine.zero_optimization_stage(), "opt": type(opt).__name__, "errors": []}
    for kw in ({"config": config(1)}, {}):
        try:
            deepspeed.initialize(args=args if kw else None, model=model(), **kw)
        except AssertionError as e:
            out["errors"].append(str(e))
    return out


def accessors() -> dict:
    out = {}
    for prec in ("bf16", "fp16"):
        cfg = {**config(1), prec: {"enabled": True}}
        e, _, _, _ = deepspeed.initialize(model=model(), config=cfg)
        out[prec] = (e.bfloat16_enabled(), e.fp16_enabled())
    cfg = {**config(3), "gradient_clipping": 0.5}
    e, _, _, _ = deepspeed.initialize(model=model(), config=cfg)
    train(e, 2)
    e.eval()
    evaluating = not e.module.training
    e.train()
    e.empty_partition_cache()
    out.update(zero=e.zero_optimization(), clip=e.gradient_clipping(), dp=e.get_data_parallel_world_size(),
               steps=e.global_steps, samples=e.global_samples, lr=e.get_lr(), evaluating=evaluating,
               training=e.module.training, partition_weights=e.zero_optimization_partition_weights(),
               boundary=e.is_gradient_accumulation_boundary(), loss_scale=e.loss_scale(),
               gathered=[g.is_gathered for gs in e.unit_groups for g in gs], dp_group=e.get_data_parallel_group())
    out["passthrough"] = e.l1 is e.module.l1 and e.forward_hidden_size() == H
    e.destroy()
    out["hooks_left"] = sum(len(mod._forward_pre_hooks) + len(mod._forward_hooks) for mod in e.module.modules())
    return out


def manual_boundary(stage: int) -> float:
    """set_gradient_accumulation_boundary(False/True) and one step() == the counted accumulation."""
    xs, ys = data(4)
    engines = []
    for manual in (False, True):
        m = model()
        e, _, _, _ = deepspeed.initialize(model=m, config=config(stage, gas=2), model_parameters=m.parameters())
        for s in range(4):
            if manual:
                e.set_gradient_accumulation_boundary(s % 2 == 1)
            e.backward(e(mine(xs[s]), mine(ys[s])))
            if not manual or s % 2 == 1:
                e.step()
        engines.append(e)
    a, b = (dict(e.module.named_parameters()) for e in engines)
    assert engines[0].global_steps == engines[1].global_steps == 2
    return max(float((safe_get_full_fp32_param(a[n]) - safe_get_full_fp32_param(b[n])).abs().max()) for n in a)


def comm_facade() -> dict:
    c = deepspeed.comm
    c.init_distributed()  # already joined: a no-op, as in DeepSpeed
    r, w = c.get_rank(), c.get_world_size()
    t = torch.tensor([r + 1.0])
    c.all_reduce(t)
    b = torch.tensor([float(r)])
    c.broadcast(b, src=1)
    lst = [torch.zeros(1) for _ in range(w)]
    c.all_gather(lst, torch.tensor([r * 10.0]))
    into = torch.zeros(w)
    c.all_gather_into_tensor(into, torch.tensor([r + 0.5]))
    rs = torch.zeros(1)
    c.reduce_scatter_tensor(rs, torch.arange(w, dtype=torch.float32) + r)
    g = c.new_group([0, 1])
    mx = torch.tensor([float(r)])
    c.all_reduce(mx, op=c.ReduceOp.MAX, group=g)
    c.barrier()
    return {"rank": r, "world": w, "local": c.get_local_rank(), "init": c.is_initialized(), "sum": t.item(),
            "bcast": b.item(), "gather": [x.item() for x in lst], "into": into.tolist(), "rs": rs.item(),
            "max": mx.item()}


def safe_accessors(stage: int, precision: str = "fp32") -> dict:
    """After one step and one more backward: fp32 params, grads and Adam state vs plain torch."""
    m, ref = model(), model()
    cfg = config(stage)
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 4}
    engine, _, _, _ = deepspeed.initialize(model=m, config=cfg, model_parameters=m.parameters())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    train(engine, 1)
    reference(ref, ref_opt, 1)
    xs, ys = data(1, seed=3)
    dt = torch.float16 if precision == "fp16" else torch.float32
    engine.backward(engine(mine(xs[0]).to(dt), mine(ys[0])))
    ref_opt.zero_grad()
    ref(xs[0], ys[0]).backward()
    got, out = dict(m.named_parameters()), {"param": 0.0, "grad": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    local = {}
    for n, rp in ref.named_parameters():
        p = got[n]
        st = ref_opt.state[rp]
        for k, a, b in (("param", safe_get_full_fp32_param(p), rp), ("grad", safe_get_full_grad(p), rp.grad),
                        ("exp_avg", safe_get_full_optimizer_state(p, "exp_avg"), st["exp_avg"]),
                        ("exp_avg_sq", safe_get_full_optimizer_state(p, "exp_avg_sq"), st["exp_avg_sq"])):
            out[k] = max(out[k], float((a - b.detach()).abs().max() / (b.abs().max() + 1e-12)))
        local[n] = {"pieces": [safe_get_local_fp32_param(p), safe_get_local_grad(p),
                               safe_get_local_optimizer_state(p, "exp_avg")],
                    "full": [safe_get_full_fp32_param(p).reshape(-1), safe_get_full_grad(p).reshape(-1),
                             safe_get_full_optimizer_state(p, "exp_avg").reshape(-1)]}
    out["local"] = local
    # setters: a full value, each rank's own piece, optimizer state, the local gradient
    p = got["l1.weight"]
    safe_set_full_fp32_param(p, torch.full(p.shape, 0.25))
    out["set_full"] = float((safe_get_full_fp32_param(p) - 0.25).abs().max())
    out["visible"] = float((p.detach().float() - 0.25).abs().max()) if stage < 3 else 0.0
    q = got["l2.weight"]
    full = safe_get_full_fp32_param(q)
    safe_set_local_fp32_param(q, safe_get_local_fp32_param(q) * 2)
    out["set_local"] = float((safe_get_full_fp32_param(q) - 2 * full).abs().max())
    safe_set_full_optimizer_state(q, torch.zeros(q.shape), "exp_avg")
    out["set_state"] = float(safe_get_full_optimizer_state(q, "exp_avg").abs().max())
    safe_set_local_grad(q, torch.zeros_like(safe_get_local_grad(q)))
    out["set_grad"] = float(safe_get_full_grad(q).abs().max())
    return out


# -- item 8: DeepSpeed's refusals -------------------------------------------------------------
def unused_parameters(ignore: bool, stage: int = 2) -> str:
    m = model(unused=True)
    cfg = config(stage, ignore_unused_parameters=ignore)
    engine, _, _, _ = deepspeed.initialize(model=m, config=cfg, model_parameters=m.parameters())
    try:
        train(engine, 2)
    except AssertionError as e:
        return str(e)
    return "trained"


def no_sync_rules(stage: int) -> dict:
    m = model()
    engine, _, _, _ = deepspeed.initialize(model=m, config=config(stage), model_parameters=m.parameters())
    out: dict = {}
    if stage >= 2:
        with engine.no_sync():  # raises: gradients are partitioned
            pass
    try:
        with engine.no_sync():
            with engine.no_sync():
                pass
    except AssertionError as e:
        out["nested"] = str(e)
    xs, ys = data(2)
    runs = []
    for _ in range(2):  # DeepSpeed's test: two no_sync passes give identical losses and local grads
        engine.zero_grad()
        with engine.no_sync():
            losses, norms = [], []
            for s in range(2):
                loss = engine(mine(xs[s]), mine(ys[s]))
                engine.backward(loss)
                losses.append(float(loss))
                norms.append(float(sum(safe_get_full_grad(p).norm() for p in m.parameters())))
            try:
                engine.step()
            except AssertionError as e:
                out["step"] = str(e)
        runs.append((losses, norms))
    out["same"] = runs[0] == runs[1]
    # the local gradient of the two micro-batches equals plain torch on this rank's samples alone
    ref = model()
    for s in range(2):
        ref(mine(xs[s]), mine(ys[s])).backward()
    out["local_grad"] = max(float((safe_get_full_grad(p) - r.grad).abs().max())
                            for p, r in zip(m.parameters(), ref.parameters(), strict=True))
    return out


def checkpoint_args(mode: str, tmp: str) -> dict:
    m = model()
    cfg = {**config(1), "checkpoint": {"tag_validation": mode}}
    engine, _, _, _ = deepspeed.initialize(model=m, config=cfg, model_parameters=m.parameters())
    out: dict = {"errors": []}
    for d in (None, ""):
        try:
            engine.save_checkpoint(save_dir=d)
        except ValueError as e:
            out["errors"].append(str(e))
    # DeepSpeed's keyword (test_checkpoint_frozen.py checks what it does)
    out["exclude_frozen"] = os.path.basename(engine.save_checkpoint(tmp, tag="frozen", exclude_frozen_parameters=True))
    try:
        out["path"] = os.path.basename(engine.save_checkpoint(tmp, tag=f"tag-{dist.get_rank()}"))
    except AssertionError as e:
        out["tag_error"] = str(e)
    return out


def zero_to_fp32_source(stage: int, tmp: str) -> dict:
    m = model()
    engine, _, _, _ = deepspeed.initialize(model=m, config=config(stage), model_parameters=m.parameters())
    train(engine, 2)
    engine.save_checkpoint(tmp)
    return {n: safe_get_full_fp32_param(p) for n, p in m.named_parameters()}



def mpu_checks() -> list[str]:
    """An mpu without Megatron's methods, or whose sizes do not multiply to the world, is refused."""
    class Partial:
        def get_model_parallel_world_size(self) -> int:
            return 1

    class Wrong(Partial):
        get_model_parallel_rank = get_data_parallel_rank = lambda self: 0  # noqa: E731
        get_model_parallel_group = get_data_parallel_group = lambda self: None  # noqa: E731
        get_data_parallel_world_size = lambda self: 1  # noqa: E731

    errors = []
    for mpu in (Partial(), Wrong()):
        try:
            deepspeed.initialize(model=model(), config=config(1), mpu=mpu)
        except (TypeError, ValueError) as e:
            errors.append(str(e))
    return errors


def no_optimizer_offload_bf16() -> dict:
    """DeepSpeed's TestNoOptim: zero.Init, stage 3 with parameter offload and bf16, forward only."""
    cfg = config(3, optimizer=False, offload_param={"device": "cpu"})
    cfg["bf16"] = {"enabled": True}
    with deepspeed.zero.Init():
        m = SimpleModel()
    engine, opt, _, _ = deepspeed.initialize(model=m, config=cfg)
    x, y = data(1)
    loss = engine(mine(x[0]).bfloat16(), mine(y[0]))
    return {"opt": opt, "finite": bool(torch.isfinite(loss)), "dtype": str(loss.dtype)}


def zero_init_client_optimizer() -> float:
    """zero.Init, then a client optimizer built on the (meta) parameters: trains as plain torch."""
    with deepspeed.zero.Init():
        m = SimpleModel()
    client = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.01)
    engine, opt, _, _ = deepspeed.initialize(model=m, config=config(3, optimizer=False), optimizer=client,
                                             model_parameters=m.parameters())
    assert opt is client
    from shardwise.zero import GatheredParameters

    with GatheredParameters(list(m.parameters())):  # the values zero.Init gave, as the reference's start
        ref = copy.deepcopy(m)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    train(engine, 2)
    reference(ref, ref_opt, 2)
    return weight_diff(engine, ref)


def allreduce_op(stage: int, op: str) -> list[float]:
    """DeepSpeed's TestGradientAllreduceOp shape: one SGD(lr=1) step on loss = w·x, x differing per rank."""
    class LinearLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(2))

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return (self.weight * inputs).sum()

    m = LinearLoss()
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
           "gradient_allreduce_op": op, "zero_optimization": {"stage": stage}}
    engine, _, _, _ = deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=1.0), config=cfg)
    x = torch.tensor([1.0, 2.0]) + dist.get_rank()
    engine.backward(engine(x))
    engine.step()
    if stage < 3:  # read straight after step(), as scripts log weights: every rank's range already updated
        return engine.module.weight.detach().tolist()
    with deepspeed.zero.GatheredParameters([engine.module.weight]):
        return engine.module.weight.detach().tolist()


def reinitialize(stage: int) -> float:
    """initialize() twice on one model (a notebook cell run again): the second engine starts from the
    first one's weights with a fresh optimizer, as in plain torch (largest weight difference)."""
    m = model()
    ref = copy.deepcopy(m)
    engine, _, _, _ = deepspeed.initialize(model=m, config=config(stage), model_parameters=m.parameters())
    train(engine, 2)
    engine, _, _, _ = deepspeed.initialize(model=m, config=config(stage), model_parameters=m.parameters())
    train(engine, 2, seed=2)
    for seed in (1, 2):
        opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
        reference(ref, opt, 2, seed=seed)
    return weight_diff(engine, ref)
