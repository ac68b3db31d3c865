"""Rank-side runs for test_whole_tensor.py: non-elementwise optimizers through both front ends, and
their single-process reference.

The reference averages the ranks' gradients as the ranks do: one backward per rank's micro batch,
then ``(g_0 + g_1) * (1 / 2)``. With 2 ranks the reduction is a single fp32 addition, which is
commutative, so the ranks' averaged gradient is bit-identical to it whatever the reduce order; whole-
tensor stepping then computes the very same update, and the tests compare weights and losses exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tiny_models import batches, build
from zero_cases import make_config

import shardwise
from shardwise.optim.ds_optimizers import Lamb, MuonWithAuxAdam, muon_param_groups, uses_muon
from shardwise.zero import GatheredParameters

STEPS, MICRO, SEQ = 3, 2, 16


class LambLike(torch.optim.Optimizer):
    """A user's LAMB-style optimizer (never registered): Adam's direction, scaled per tensor by
    ``||w|| / ||update||``. On a flat shard the ratio would be that of a slice of two tensors."""

    def __init__(self, params, lr: float = 1e-2, betas=(0.9, 0.99), eps: float = 1e-6):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["m"], st["v"] = torch.zeros_like(p), torch.zeros_like(p)
                st["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = st["m"] / (st["v"].sqrt() + group["eps"])
                ratio = p.norm() / update.norm().clamp_min(1e-12)
                p.sub_(update * (group["lr"] * ratio))


class SignMomentum(torch.optim.Optimizer):
    """A user's elementwise optimizer, declared so: it keeps flat sharding."""

    shardwise_elementwise = True

    def __init__(self, params, lr: float = 1e-3, beta: float = 0.9):
        super().__init__(params, dict(lr=lr, beta=beta))
        self.seen_shapes: set[tuple[int, ...]] = set()

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.seen_shapes.add(tuple(p.shape))
                st = self.state.setdefault(p, {})
                buf = st.setdefault("buf", torch.zeros_like(p))
                buf.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.sub_(buf.sign(), alpha=group["lr"])


class ShapeProbe(torch.optim.Optimizer):
    """An unknown optimizer that only records the shapes it is asked to step (and does SGD)."""

    def __init__(self, params, lr: float = 1e-3):
        super().__init__(params, dict(lr=lr))
        self.seen_shapes: set[tuple[int, ...]] = set()

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.seen_shapes.add(tuple(p.shape))
                    p.sub_(p.grad, alpha=group["lr"])


def _muon_torch_groups(model) -> list[dict]:
    """torch.optim.Muon takes 2-D tensors only: hidden matrices at one lr, embedding and head at another
    (the 1-D norms are frozen in this case, in the reference too)."""
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and uses_muon(n, p)]
    edges = [p for n, p in model.named_parameters() if p.ndim == 2 and not uses_muon(n, p)]
    return [{"params": hidden, "lr": 0.02}, {"params": edges, "lr": 0.01}]


def _muon_config_groups(model) -> list[dict]:
    for n, p in model.named_parameters():
        p.shardwise_name = n
    return muon_param_groups([{"params": list(model.parameters())}], MUON_PARAMS)


MUON_PARAMS = {"lr": 0.01, "muon_lr": 0.02, "adam_lr": 3e-3, "weight_decay": 0.01}
LAMB_PARAMS = {"lr": 3e-3, "weight_decay": 0.01}

# name -> (class, param groups of a model or None for all parameters, defaults, config optimizer section)
CASES = {
    "adafactor": (torch.optim.Adafactor, None, {"lr": 1e-2}, None),
    "adafactor_factory": (torch.optim.Adafactor, None, {"lr": 1e-2}, None),  # initialize(optimizer=callable)
    "adamw_factory": (torch.optim.AdamW, None, {"lr": 1e-3}, None),
    "muon_torch": (torch.optim.Muon, _muon_torch_groups, {"weight_decay": 0.01}, None),
    "lamb_like": (LambLike, None, {"lr": 1e-2}, None),
    "sign_momentum": (SignMomentum, None, {"lr": 1e-3}, None),
    "lamb_config": (Lamb, None, LAMB_PARAMS, {"type": "Lamb", "params": LAMB_PARAMS}),
    "muon_config": (MuonWithAuxAdam, _muon_config_groups, {}, {"type": "Muon", "params": MUON_PARAMS}),
}


def _model(case: str):
    model = build("llama")
    if case == "muon_torch":
        for p in model.parameters():
            p.requires_grad_(p.ndim == 2)
    return model


def _groups(case: str, model) -> list[dict]:
    cls, groups, defaults, _ = CASES[case]
    return groups(model) if groups is not None else [{"params": [p for p in model.parameters() if p.requires_grad]}]


def reference(case: str, world: int = 2, steps: int = STEPS) -> dict:
    """One process: each rank's micro batch backward on its own, gradients averaged as the ranks do
    (2 ranks, or 4 as 2 replicas of shard groups of 2: ``((g0 + g1) + (g2 + g3)) / 4``, where every
    sum has two terms, so its order cannot matter)."""
    assert world in (2, 4)
    cls, _, defaults, _ = CASES[case]
    model = _model(case)
    opt = cls(_groups(case, model), **defaults)
    params = [p for p in model.parameters() if p.requires_grad]
    data = batches(steps, 1, MICRO * world, SEQ)
    losses: dict[int, list[float]] = {r: [] for r in range(world)}
    for s in range(steps):
        per_rank = []
        for r in range(world):
            model.zero_grad(set_to_none=True)
            ids = data[s, 0, r * MICRO:(r + 1) * MICRO]
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses[r].append(float(loss.detach()))
            per_rank.append([p.grad.clone() for p in params])
        for i, p in enumerate(params):  # ranks (0, 1) reduce-scatter, then replicas (hybrid) all-reduce
            pairs = [per_rank[r][i] + per_rank[r + 1][i] for r in range(0, world, 2)]
            total = pairs[0] if len(pairs) == 1 else pairs[0] + pairs[1]
            p.grad = total.mul_(1.0 / world)
        opt.step()
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _train(step, model, rank: int) -> list[float]:
    data = batches(STEPS, 1, MICRO * dist.get_world_size(), SEQ)
    losses = []
    for s in range(STEPS):
        ids = data[s, 0, rank * MICRO:(rank + 1) * MICRO]
        losses.append(step(model(input_ids=ids, labels=ids).loss))
    return losses


def _functional(case: str, stage: int, shard_size: int | None = None) -> dict:
    cls, _, defaults, _ = CASES[case]
    model = shardwise.shard(_model(case), stage=stage, bucket_size=20_000, shard_size=shard_size,
                            persistence_threshold=0)  # stage 3: every tensor sharded, none kept whole
    opt = shardwise.ShardedOptimizer(model, cls, param_groups=_groups(case, model), **defaults)

    def step(loss: torch.Tensor) -> float:
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    losses = _train(step, model, dist.get_rank())
    sd = shardwise.full_state_dict(model)
    return {"losses": losses, "weights": {n: t.float() for n, t in sd.items()} if sd else {},
            "inner": opt.optimizer, "memory": None}


def _engine(case: str, stage: int) -> dict:
    cls, _, defaults, section = CASES[case]
    model = _model(case)
    cfg = make_config(stage, optimizer=False, stage3_param_persistence_threshold=0)
    client = None
    if section is not None:
        cfg["optimizer"] = section
    elif case.endswith("_factory"):
        def client(groups):
            return cls(groups, **defaults)
    else:
        client = cls(_groups(case, model), **defaults)
    engine, opt, _, _ = shardwise.initialize(model=model, config=cfg, optimizer=client)

    def step(loss: torch.Tensor) -> float:
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    losses = _train(step, engine, dist.get_rank())
    with GatheredParameters(list(model.parameters())):
        weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "weights": weights if dist.get_rank() == 0 else {}, "inner": opt,
            "memory": engine.memory_report()}


def train_case(case: str, stages: tuple[int, ...] = (1, 2, 3), apis: tuple[str, ...] = ("functional", "engine"),
               shard_size: int | None = None) -> dict:
    """Every stage and front end of one case: losses, rank 0's weights, the shapes the optimizer stepped.
    ``shard_size``: hybrid sharding (functional API only)."""
    out = {}
    for api in apis:
        for stage in stages:
            run = _functional(case, stage, shard_size) if api == "functional" else _engine(case, stage)
            opt = run.pop("inner")
            run["shapes"] = sorted({tuple(p.shape) for g in opt.param_groups for p in g["params"]})
            run["seen"] = sorted(getattr(opt, "seen_shapes", set()))
            run["owned_numel"] = sum(p.numel() for g in opt.param_groups for p in g["params"])
            out[f"{api}:{stage}"] = run
    return out


def train_probe(stage: int) -> dict:
    """An unknown optimizer class through both front ends: the shapes it was handed and asked to step."""
    model = shardwise.shard(build("llama"), stage=stage, bucket_size=20_000)
    opt = shardwise.ShardedOptimizer(model, ShapeProbe, lr=1e-3)
    model(input_ids=batches(1, 1, 2, SEQ)[0, 0], labels=batches(1, 1, 2, SEQ)[0, 0]).loss.backward()
    opt.step()
    model_shapes = sorted({tuple(p.shape) for p in build("llama").parameters()})
    return {"seen": sorted(opt.optimizer.seen_shapes), "model_shapes": model_shapes}


def tp_refusal() -> str:
    """A TP-sliced matrix cannot be stepped whole by a non-elementwise optimizer: refused by name."""
    from shardwise.layout import get_mesh
    from shardwise.tensor_parallel import apply_tensor_parallel

    mesh = get_mesh(2, None)
    model = build("llama")
    apply_tensor_parallel(model, mesh.tp)
    model = shardwise.shard(model, stage=1, mesh=mesh)
    try:
        shardwise.ShardedOptimizer(model, torch.optim.Adafactor, lr=1e-2)
    except ValueError as e:
        return str(e)
    return ""


# -- checkpoints of whole-tensor optimizer state (test_whole_tensor.py) -----------------------------
SAVE_AT, RESUME_STEPS = 3, 2  # save after 3 steps, then 2 more: the uninterrupted run and the resumes


def _resumable(case: str, api: str, stage: int, world: int = 2, seed: int = 0):
    """(step(ids) -> loss, save(dir), load(dir), weights()) of one front end; ``seed`` != 0 starts from other
    weights, so that a resume that loads nothing cannot pass. At world 1 a step is two half-loss
    backward passes of the two ranks' micro batches (halving is exact: the same averaged gradient)."""
    cls, _, defaults, _ = CASES[case]
    model = _model(case) if seed == 0 else _reseeded(case, seed)
    if api == "engine":
        cfg = make_config(stage, optimizer=False, dp=world, stage3_param_persistence_threshold=0)
        engine, *_ = shardwise.initialize(model=model, config=cfg, optimizer=cls(_groups(case, model),
                                                                                           **defaults))
        fwd, back, step = engine, engine.backward, engine.step
        save, load = engine.save_checkpoint, engine.load_checkpoint
    else:
        model = shardwise.shard(model, stage=stage, bucket_size=20_000, persistence_threshold=0)
        opt = shardwise.ShardedOptimizer(model, cls, param_groups=_groups(case, model), **defaults)
        fwd, back = model, lambda loss: loss.backward()

        def step() -> None:
            opt.step()
            opt.zero_grad()

        def save(d: str) -> str:
            return shardwise.save_checkpoint(d, model, opt)

        def load(d: str):
            return shardwise.load_checkpoint(d, model, opt)

    def train(ids: torch.Tensor) -> float:
        parts = [ids] if world == 2 else [ids[:MICRO], ids[MICRO:]]
        losses = []
        for part in parts:
            loss = fwd(input_ids=part, labels=part).loss
            back(loss if world == 2 else loss * 0.5)
            losses.append(float(loss.detach()))
        step()
        return losses[0] if world == 2 else sum(losses) / 2

    def weights() -> dict:
        with GatheredParameters(list(model.parameters())):
            return {n: p.detach().float().clone() for n, p in model.named_parameters()}

    return train, save, load, weights


def _reseeded(case: str, seed: int):
    model = build("llama", seed=seed)
    if case == "muon_torch":
        for p in model.parameters():
            p.requires_grad_(p.ndim == 2)
    return model


def _steps(train, first: int, world: int) -> list[float]:
    data = batches(SAVE_AT + RESUME_STEPS, 1, MICRO * 2, SEQ)
    rank = dist.get_rank() if world == 2 else 0
    ids = (lambda s: data[s, 0, rank * MICRO:(rank + 1) * MICRO]) if world == 2 else (lambda s: data[s, 0])
    return [train(ids(s)) for s in range(first, SAVE_AT + RESUME_STEPS if first else SAVE_AT)]


def save_and_resume(case: str, api: str, ckpt: str) -> dict:
    """2 ranks: train 3 steps at stage 2 and save, then 2 more (uninterrupted); resume from the
    checkpoint at stage 2 (same layout) and at stage 3, each from other initial weights."""
    train, save, _, weights = _resumable(case, api, 2)
    _steps(train, 0, 2)
    save(ckpt)
    out = {"uninterrupted": {"losses": _steps(train, SAVE_AT, 2), "weights": weights()}}
    for stage in (2, 3):
        train, _, load, weights = _resumable(case, api, stage, seed=7)
        load(ckpt)
        out[f"stage{stage}"] = {"losses": _steps(train, SAVE_AT, 2), "weights": weights()}
    return out


def resume_world1(case: str, api: str, ckpt: str) -> dict:
    """One process (a 1-rank group): load the 2-rank checkpoint and continue for 2 steps."""
    train, _, load, weights = _resumable(case, api, 2, world=1, seed=7)
    load(ckpt)
    return {"losses": _steps(train, SAVE_AT, 1), "weights": weights()}


def load_error(case: str, ckpt: str, api: str = "functional") -> str:
    """The CheckpointError a load raises (one process), or '' when it loaded."""
    _, _, load, _ = _resumable(case, api, 2, world=1, seed=7)
    try:
        load(ckpt)
    except shardwise.checkpoint.CheckpointError as e:
        return str(e)
    return ""
