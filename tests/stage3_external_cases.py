"""Rank-side stage-3 external-parameter cases on plain nn.Module models (used by test_stage3_external.py).

Every model's forward is ``forward(x, y) -> loss``; :func:`train_ranks` trains it at stage 3 on this
rank's slice of a global batch, :func:`reference` trains it in one process with plain AdamW.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from zero_cases import BETAS, EPS, LR, WD, make_config

import shardwise
from shardwise.zero import GatheredParameters

HIDDEN, VOCAB, STEPS, MICRO = 16, 37, 3, 2


class SimpleModel(nn.Module):
    """DeepSpeed's unit-test model: Linear layers in a ModuleList, a CrossEntropyLoss."""

    def __init__(self, hidden_dim: int = HIDDEN, nlayers: int = 2):
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)])
        self.cross_entropy_loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        if len(self.linears) == 1:
            x = self.linears[0](x)
        else:
            for i, layer in enumerate(self.linears):
                x = self.linears[i // 2](x) + layer(x)  # layer 0 runs three times per forward
        return self.cross_entropy_loss(x, y)


class SequentialModel(nn.Module):
    """A plain nn.Sequential inside a loss wrapper."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(HIDDEN, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
                                 nn.Linear(24, HIDDEN))

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


class Head(nn.Module):
    """Output head reusing the embedding's weight (DeepSpeed's external-parameter pattern).

    ``cached=False`` reads ``embed.weight`` as an attribute in forward; ``cached=True`` keeps the
    tensor itself in a list, which no attribute hook sees.
    """

    def __init__(self, embed: nn.Embedding, cached: bool):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(embed.num_embeddings))
        self._embed = [embed]  # a plain list: the embedding stays a unit of its own, not shared
        self._weight = [embed.weight] if cached else None

    def forward(self, h):
        w = self._weight[0] if self._weight is not None else self._embed[0].weight
        return F.linear(h, w, self.bias)


class ExternalModel(nn.Module):
    """Embedding -> two blocks -> head on the embedding's weight; the root also reads a block's weight."""

    def __init__(self, cached: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(2)])
        self.head = Head(self.embed, cached)

    def forward(self, x, y):
        h = self.embed(x)
        for b in self.blocks:
            h = torch.tanh(b(h))
        h = h + 0.5 * F.linear(h, self.blocks[0].weight)  # the parent uses a unit's weight directly
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


class TiedModel(nn.Module):
    """Embedding and output Linear share one weight (two units, one parameter)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.block = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x, y):
        return F.cross_entropy(self.out(torch.tanh(self.block(self.embed(x)))).flatten(0, 1), y.flatten())


class Experts(nn.Module):
    """Top-1 routing: only the experts some token picks run (a z3 leaf candidate)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, 3)
        self.experts = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(3)])

    def forward(self, h):
        pick = self.gate(h).argmax(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            sel = pick == e
            if sel.any():
                out[sel] = expert(h[sel])
        return h + out


class MoEModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.moe = Experts()
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, y):
        return F.cross_entropy(self.out(self.moe(torch.tanh(self.inp(x)))), y)


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return {"simple": SimpleModel, "sequential": SequentialModel, "external": ExternalModel,
            "cached": lambda: ExternalModel(cached=True), "tied": TiedModel, "moe": MoEModel}[kind]()


def data(kind: str, world: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) shaped [steps, world * micro, ...]: features for the Linear models, tokens otherwise."""
    g = torch.Generator().manual_seed(1)
    n = world * MICRO
    if kind in ("external", "cached", "tied"):
        x = torch.randint(0, VOCAB, (STEPS, n, 5), generator=g)
        return x, torch.randint(0, VOCAB, (STEPS, n, 5), generator=g)
    return torch.randn(STEPS, n, HIDDEN, generator=g), torch.randint(0, HIDDEN, (STEPS, n), generator=g)


def _setup(kind: str, register: bool, leaf: bool) -> nn.Module:
    model = build(kind)
    if register:  # DeepSpeed's explicit form, for the cached reference no hook sees
        shardwise.zero.register_external_parameter(model.head, model.embed.weight)
    if leaf:
        shardwise.zero.set_z3_leaf_modules(model, [Experts])
    return model


def train_ranks(kind: str, register: bool = False, leaf: bool = False, as_list: bool = False) -> dict:
    """Stage 3 on 2 ranks; ``as_list``: model_parameters as param-group dicts (no decay on biases)."""
    model = _setup(kind, register, leaf)
    cfg = make_config(3, micro=MICRO, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=400)
    params = _param_groups(model) if as_list else model.parameters()
    engine, *_ = shardwise.initialize(model=model, config=cfg, model_parameters=params)
    rank = dist.get_rank()
    xs, ys = data(kind)
    losses = []
    for s in range(STEPS):
        sl = slice(rank * MICRO, (rank + 1) * MICRO)
        loss = engine(xs[s, sl], ys[s, sl])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    with GatheredParameters(model.parameters()):
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    units = [type(u).__name__ for u in engine.units]
    return {"losses": losses, "weights": weights if rank == 0 else None, "units": units}


def _param_groups(model: nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0, "lr": 2 * LR}]


def _row_mean(forward, n: int) -> torch.Tensor:
    """The micro batch's mean loss as the mean of per-row forwards: equal in exact arithmetic,
    other GEMM shapes and summation order in fp32 (the noise floor, tests/tolerance.py)."""
    return sum(forward(slice(i, i + 1)) for i in range(n)) / n


def with_tolerance(run) -> dict:
    """``run(per_row)`` twice: the reference, and its per-row twin whose distance sets the bound."""
    from tolerance import equivalence_tol
    from zero_cases import measured_noise

    ref = run(False)
    ref["noise"] = measured_noise(ref, [run(True)])
    ref["tol"] = equivalence_tol(ref["noise"], STEPS)
    return ref


def reference(kind: str, as_list: bool = False, world: int = 2) -> dict:
    """One process, plain AdamW on the same global batch (each rank's loss averaged as DP does)."""
    return with_tolerance(lambda per_row: _reference_run(kind, as_list, world, per_row))


def _reference_run(kind: str, as_list: bool, world: int, per_row: bool) -> dict:
    model = build(kind)
    groups = _param_groups(model) if as_list else [{"params": list(model.parameters())}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    xs, ys = data(kind, world)
    losses = {r: [] for r in range(world)}
    for s in range(STEPS):
        opt.zero_grad(set_to_none=False)
        for r in range(world):
            x, y = xs[s, r * MICRO:(r + 1) * MICRO], ys[s, r * MICRO:(r + 1) * MICRO]
            loss = _row_mean(lambda i, x=x, y=y: model(x[i], y[i]), MICRO) if per_row else model(x, y)
            (loss / world).backward()
            losses[r].append(float(loss.detach()))
        opt.step()
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def cached_reference_fails() -> str:
    """A cached reference, not registered: the first forward must raise the clear error, not NaN."""
    model = build("cached")
    engine, *_ = shardwise.initialize(model=model, config=make_config(3, micro=MICRO,
                                                                      stage3_param_persistence_threshold=0))
    xs, ys = data("cached")
    try:
        loss = engine(xs[0, :MICRO], ys[0, :MICRO])
    except shardwise.zero.ReleasedParameterError as e:
        return str(e)
    return f"no error; loss={float(loss)}"


# -- zero.Init models: model_parameters as a generator / group dicts, GatheredParameters before initialize


def _hf_groups(model: nn.Module) -> list[dict]:
    plain = [p for n, p in model.named_parameters() if n.endswith("bias") or "norm" in n or "ln_" in n]
    ids = {id(p) for p in plain}
    return [{"params": (p for p in model.parameters() if id(p) not in ids), "weight_decay": WD},
            {"params": plain, "weight_decay": 0.0, "lr": 2 * LR}]


def _edited(model: nn.Module, kind: str) -> nn.Parameter:
    return model.model.layers[0].mlp.up_proj.weight if kind == "llama" else model.transformer.h[0].mlp.c_fc.weight


def _edit(w: torch.Tensor) -> None:
    with torch.no_grad():
        w.mul_(-0.5)
        w[0].fill_(0.25)


def hf_under_init(kind: str, folder: str, groups: bool, edit: bool, steps: int = 3) -> dict:
    """Build under zero.Init from ``folder``; optionally edit a weight in GatheredParameters first."""
    from tiny_models import batches
    from tiny_models import build as build_hf
    from transformers import AutoModelForCausalLM

    rank = dist.get_rank()
    with shardwise.zero.Init():
        model = AutoModelForCausalLM.from_pretrained(folder)
    model.train()
    out: dict = {}
    if edit:
        w = _edited(model, kind)
        with GatheredParameters([w], modifier_rank=0):
            out["inside_is_checkpoint"] = bool(torch.equal(w, _edited(build_hf(kind), kind)))
            if rank == 0:
                _edit(w)
    params = _hf_groups(model) if groups else model.parameters()
    cfg = make_config(3, stage3_param_persistence_threshold=0)
    engine, *_ = shardwise.initialize(model=model, config=cfg, model_parameters=params)
    data = batches(steps, 1, 4, 16)
    losses = []
    for s in range(steps):
        ids = data[s, 0, rank * 2:(rank + 1) * 2]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    with GatheredParameters(model.parameters()):
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {**out, "losses": losses, "weights": weights if rank == 0 else None}


def hf_reference(kind: str, groups: bool, edit: bool, steps: int = 3) -> dict:
    assert steps == STEPS
    return with_tolerance(lambda per_row: _hf_reference_run(kind, groups, edit, steps, per_row))


def _hf_reference_run(kind: str, groups: bool, edit: bool, steps: int, per_row: bool) -> dict:
    from tiny_models import batches
    from tiny_models import build as build_hf

    model = build_hf(kind)
    if edit:
        _edit(_edited(model, kind))
    params = _hf_groups(model) if groups else model.parameters()
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    data = batches(steps, 1, 4, 16)
    losses = {0: [], 1: []}
    for s in range(steps):
        opt.zero_grad(set_to_none=False)
        for r in range(2):
            ids = data[s, 0, r * 2:(r + 1) * 2]
            loss = (_row_mean(lambda i, ids=ids: model(input_ids=ids[i], labels=ids[i]).loss, 2) if per_row
                    else model(input_ids=ids, labels=ids).loss)
            (loss / 2).backward()
            losses[r].append(float(loss.detach()))
        opt.step()
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


def gathered_from_config() -> dict:
    """zero.Init from a config (the model's own init): edit one weight on rank 1 before initialize."""
    from tiny_models import build as build_hf
    from transformers import AutoModelForCausalLM

    cfg = build_hf("llama").config
    with shardwise.zero.Init():
        model = AutoModelForCausalLM.from_config(cfg)
    w = model.model.layers[1].self_attn.q_proj.weight
    with GatheredParameters([w], modifier_rank=1):
        std_inside = float(w.std())
        if dist.get_rank() == 1:
            with torch.no_grad():
                w.fill_(0.125)
    read_only = model.model.layers[0].self_attn.q_proj.weight
    with GatheredParameters([read_only]):  # no modifier_rank: values visible, then back to meta
        finite = bool(torch.isfinite(read_only).all())
    engine, *_ = shardwise.initialize(model=model, config=make_config(3, stage3_param_persistence_threshold=0),
                                      model_parameters=model.parameters())
    layer = model.model.layers[1].self_attn
    with GatheredParameters(list(layer.parameters())):
        seen = float(w.mean())
        sibling_std = float(layer.k_proj.weight.std())
    return {"std_inside": std_inside, "seen": seen, "sibling_std": sibling_std, "finite": finite,
            "back_to_meta": bool(read_only.is_meta)}
