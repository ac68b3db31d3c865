"""Optimizers and LR schedulers named in DeepSpeed configs.

The engine steps torch optimizers over sharded fp32 master tensors, so everything here builds plain
``torch.optim`` objects; the only DeepSpeed-specific parts are the config semantics (``Adam`` means
AdamW unless ``adam_w_mode`` is false) and the exact scheduler formulas.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import SGD, Adam, AdamW, Optimizer
from torch.optim.lr_scheduler import LRScheduler

from shardwise.config.schema import OPTIMIZERS as CONFIG_OPTIMIZERS
from shardwise.config.schema import SCHEDULERS as CONFIG_SCHEDULERS
from shardwise.optim.ds_optimizers import MUON_CONFIG_KEYS, Lamb, MuonWithAuxAdam, muon_param_groups

__all__ = [
    "build_optimizer",
    "rebuild_client_optimizer",
    "client_param_groups",
    "build_scheduler",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
]

# The names come from the config schema (the one list of what the config accepts).
_SUPPORTED_OPTIMIZERS = tuple(name for name, _ in CONFIG_OPTIMIZERS.values())
_SUPPORTED_SCHEDULERS = tuple(CONFIG_SCHEDULERS)


def _accepted_kwargs(cls: type) -> set[str]:
    """Constructor keywords of an optimizer/scheduler class, minus the positional inputs."""
    names = set(inspect.signature(cls.__init__).parameters)
    return names - {"self", "params", "optimizer"}


def _reject_unknown(section: str, given: dict, cls: type) -> None:
    """Name the first config key the target class would reject with a bare TypeError."""
    accepted = _accepted_kwargs(cls)
    unknown = sorted(set(given) - accepted)
    if unknown:
        raise ValueError(
            f"{section}.{unknown[0]} is not a {cls.__name__} parameter "
            f"(accepted: {', '.join(sorted(accepted))})"
        )


def _kernel_kwargs(groups: list[dict], fused: bool | None, foreach: bool | None) -> dict[str, bool]:
    """Pick torch's multi-tensor kernel.

    Measured on this repo's 2-core CPU box (torch 2.13, 10 fp32 tensors of 1M elements, ms per
    step): AdamW foreach 27.0 / fused 4.1 / per-tensor 29.0; Adam 25.9 / 4.4 / 27.1; SGD with
    momentum 4.5 / 2.8 / 4.7. Fused wins everywhere, so it is the default on CPU and CUDA;
    foreach is the fallback for other devices (meta, mps, ...) and non-float tensors.
    """
    if fused is not None:
        return {"fused": True} if fused else {"foreach": True if foreach is None else foreach}
    if foreach is not None:
        return {"foreach": foreach}
    tensors = [p for g in groups for p in g["params"]]
    ok = bool(tensors) and all(
        p.device.type in ("cpu", "cuda")
        and p.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
        for p in tensors
    )
    return {"fused": True} if ok else {"foreach": True}


def build_optimizer(opt_type: str, params: dict, param_groups: list[dict]) -> Optimizer:
    """Build the torch optimizer a DeepSpeed ``optimizer`` config section describes.

    DeepSpeed's ``Adam`` defaults to ``adam_w_mode=true`` (decoupled decay, i.e. AdamW) and its
    fused Adam defaults ``weight_decay`` to 0, unlike ``torch.optim.AdamW`` (0.01); both are kept.
    ``torch_adam=true`` in DeepSpeed means "use torch's class with torch's defaults", also kept.
    """
    name = opt_type.lower()
    kw: dict[str, Any] = dict(params)
    torch_adam = bool(kw.pop("torch_adam", False))
    adam_w_mode = bool(kw.pop("adam_w_mode", True))
    fused = kw.pop("fused", None)
    foreach = kw.pop("foreach", None)
    cls: type[Optimizer]
    if name in ("adam", "adamw"):
        if not kw.pop("bias_correction", True):
            raise ValueError(
                "optimizer.params.bias_correction=false is not supported (torch Adam always corrects)"
            )
        cls = AdamW if (name == "adamw" or adam_w_mode) else Adam
        if not torch_adam:
            kw.setdefault("weight_decay", 0.0)
        if "betas" in kw:
            kw["betas"] = tuple(kw["betas"])
    elif name == "sgd":
        cls = SGD
    elif name in ("lamb", "muon"):
        return _build_whole_tensor_optimizer(name, kw, param_groups)
    else:
        raise ValueError(
            f"optimizer.type {opt_type!r} is not supported; supported: {', '.join(_SUPPORTED_OPTIMIZERS)}"
        )
    _reject_unknown("optimizer.params", kw, cls)
    kw.update(_kernel_kwargs(param_groups, fused, foreach))
    return cls(param_groups, **kw)


def config_optimizer_class(opt_type: str) -> type[Optimizer]:
    """The class ``build_optimizer`` makes for a config ``optimizer.type`` (tells flat from whole-tensor)."""
    return {"lamb": Lamb, "muon": MuonWithAuxAdam, "sgd": SGD, "adam": Adam}.get(opt_type.lower(), AdamW)


def _build_whole_tensor_optimizer(name: str, kw: dict[str, Any], param_groups: list[dict]) -> Optimizer:
    """DeepSpeed's Lamb (FusedLamb) or Muon (MuonWithAuxAdam) over whole tensors (ds_optimizers.py)."""
    if name == "muon":
        unknown = sorted(set(kw) - set(MUON_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"optimizer.params.{unknown[0]} is not a Muon parameter "
                             f"(accepted: {', '.join(sorted(MUON_CONFIG_KEYS))})")
        return MuonWithAuxAdam(muon_param_groups(param_groups, kw))
    if kw.pop("amsgrad", False):
        raise ValueError("optimizer.params.amsgrad=true: DeepSpeed's Lamb does not support AMSGrad")
    if kw.pop("max_grad_norm", 0.0):
        raise ValueError("optimizer.params.max_grad_norm: Lamb's own clipping is not implemented; use "
                         "gradient_clipping, which clips the same global norm before the step")
    _reject_unknown("optimizer.params", kw, Lamb)
    return Lamb(param_groups, **kw)


def client_param_groups(model: torch.nn.Module, model_parameters: Any, client: Any) -> list[dict]:
    """The optimizer param groups the engine builds its shards for, as DeepSpeed picks them.

    A client optimizer *instance* defines them itself (``model_parameters`` only matters to a
    config optimizer or a factory). Groups without parameters are dropped, as DeepSpeed drops
    them from the optimizer it returns.
    """
    from shardwise.zero.partition import normalize_param_groups

    if isinstance(client, Optimizer):
        groups = [{**g, "params": list(g["params"])} for g in client.param_groups]
    else:
        groups = normalize_param_groups(model, model_parameters)
    kept = [g for g in groups if g["params"]]
    if not kept:
        raise ValueError("the optimizer has no parameters: every param group given "
                         "(optimizer= or model_parameters=) is empty")
    return kept


def rebuild_client_optimizer(
    client: Optimizer | Callable[[list], Optimizer], new_param_groups: list[list[torch.Tensor]] | list[dict]
) -> Optimizer:
    """Point a user's optimizer at the engine's master tensors; returns the optimizer to step.

    The user built ``client`` over the model's parameters; the engine steps sharded fp32 masters
    instead. As DeepSpeed's ZeRO optimizers do, the client object itself is kept and each of its
    non-empty param groups gets the engine's tensors (group ``i`` -> ``new_param_groups[i]``), so
    ``initialize`` returns the very object the user passed, with its class, hyperparameters and any
    scheduler built on it intact. Empty groups are removed from it, as DeepSpeed removes them.
    State cannot be carried over (it is keyed by the old tensors and unsharded), so a stepped
    optimizer is refused. A callable (DeepSpeed's ``optimizer=lambda params: ...``) is called with
    the group dicts (hyperparameters of ``model_parameters`` groups included).
    """
    groups = [g if isinstance(g, dict) else {"params": list(g)} for g in new_param_groups]
    if isinstance(client, Optimizer):
        if any(len(s) for s in client.state.values()):
            raise ValueError(
                f"the {type(client).__name__} passed as optimizer= already has state (it was stepped "
                "or loaded); pass a freshly constructed optimizer and load its state through the engine"
            )
        client.param_groups[:] = [pg for pg in client.param_groups if len(pg["params"])]
        if len(client.param_groups) != len(groups):
            raise ValueError(
                f"client optimizer has {len(client.param_groups)} param groups but the engine built "
                f"{len(groups)}"
            )
        for pg, new in zip(client.param_groups, groups, strict=True):
            pg["params"] = list(new["params"])
        client.state.clear()
        return client
    if callable(client):
        opt = client([{**g, "params": list(g["params"])} for g in groups])
        if not isinstance(opt, Optimizer):
            raise TypeError(
                f"optimizer callable returned {type(opt).__name__}, expected torch.optim.Optimizer"
            )
        return opt
    raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable, got {type(client).__name__}")


# ----------------------------------------------------------------------------------------------
# Schedulers
# ----------------------------------------------------------------------------------------------


class _IterationLR(LRScheduler):
    """Closed-form scheduler with DeepSpeed's iteration numbering.

    ``last_batch_iteration`` (== torch's ``last_epoch``) starts at -1 and the constructor writes the
    lr for iteration -1 into the optimizer: that lr is used by the FIRST optimizer step. DeepSpeed's
    engine calls ``step()`` after every successful optimizer step (not after fp16-skipped ones), so
    optimizer step k (1-based) runs with the lr of iteration k-2 (iteration -1 for k=1, 0 for k=2).
    ``step(n)`` jumps to iteration n, as in DeepSpeed.
    """

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int = -1) -> None:
        super().__init__(optimizer, last_epoch=-1)  # torch's initial step lands on 0; undo it below
        self.last_epoch = last_batch_iteration
        self._apply()

    @property
    def last_batch_iteration(self) -> int:
        return self.last_epoch

    def lr_at(self, iteration: int) -> list[float]:
        """Per-group lr at a DeepSpeed iteration index (pure, for tests and the estimator)."""
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self.lr_at(self.last_epoch)

    _get_closed_form_lr = get_lr

    def step(self, last_batch_iteration: int | None = None) -> None:  # type: ignore[override]
        if last_batch_iteration is not None:
            self.last_epoch = last_batch_iteration - 1
        super().step()

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [float(g["lr"]) for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """torch's state plus DeepSpeed's single key, so either side can read it."""
        sd = super().state_dict()
        sd["last_batch_iteration"] = self.last_epoch
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accept ours or DeepSpeed's ``{"last_batch_iteration": n}``; re-applies the lr."""
        sd = dict(state_dict)
        it = sd.pop("last_batch_iteration", None)
        if "last_epoch" in sd:
            super().load_state_dict(sd)
        elif it is not None:
            self.last_epoch = int(it)
        else:
            raise KeyError("scheduler state has neither 'last_epoch' nor 'last_batch_iteration'")
        self._apply()


def _per_group(value: float | list | tuple, n: int, name: str) -> list[float]:
    if isinstance(value, list | tuple):
        if len(value) != n:
            raise ValueError(f"scheduler.params.{name} has {len(value)} values for {n} param groups")
        return [float(v) for v in value]
    return [float(value)] * n


def _check_warmup_type(warmup_type: str) -> str:
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"scheduler.params.warmup_type must be 'log' or 'linear', got {warmup_type!r}")
    return warmup_type


def _warmup_gamma(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """0 -> 1 warmup fraction; ``warmup_num_steps`` is already clamped to >= 2."""
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


class WarmupLR(_IterationLR):
    """DeepSpeed WarmupLR: lr = min + (max - min) * gamma, ignoring the optimizer's own lr.

    gamma = log(i + 1) / log(W) ("log") or i / W ("linear") for 0 <= i < W, W = max(2,
    warmup_num_steps); gamma = 1 afterwards. Iteration -1 (before the first step()) uses min_lr.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 1e-3,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        n = len(optimizer.param_groups)
        self.min_lrs = _per_group(warmup_min_lr, n, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, n, "warmup_max_lr")
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = _check_warmup_type(warmup_type)
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lr_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        g = self._gamma(iteration)
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """DeepSpeed WarmupDecayLR: WarmupLR, then linear decay to 0 at ``total_num_steps``.

    After warmup gamma = max(0, (T - i) / max(1, T - W)); note gamma is 1 at i = W exactly.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 1e-3,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = int(total_num_steps)
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
        return max(
            0.0, (self.total_num_steps - iteration) / max(1.0, self.total_num_steps - self.warmup_num_steps)
        )


class WarmupCosineLR(_IterationLR):
    """DeepSpeed WarmupCosineLR: a ratio of each group's lr at construction time.

    Warmup (0 <= i < W, W = max(2, warmup_num_steps)): ratio = r0 + (1 - r0) * gamma, gamma as in
    WarmupLR. After: ratio = max(0, c + (1 - c) * (1 + cos(pi * (i - W + 1) / (T - W))) / 2) with
    c = cos_min_ratio: note DeepSpeed's ``+ 1`` (ratio < 1 already at i = W, c at i = T - 1) and no
    clamp, so past T the cosine rises again exactly as in DeepSpeed. Differences from DeepSpeed:
    T - W <= 0 divides by 1 instead of raising ZeroDivisionError, and iteration -1 sets lr 0 in
    every group (DeepSpeed writes 0 into group 0 only and leaves the others at their initial lr).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 1e-4,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = _check_warmup_type(warmup_type)
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def ratio_at(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            g = _warmup_gamma(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * g
        progress = (iteration - self.warmup_num_steps + 1) / max(
            1, self.total_num_steps - self.warmup_num_steps
        )
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, iteration: int) -> list[float]:
        r = self.ratio_at(iteration)
        return [lr * r for lr in self.org_lrs]


_SCHEDULERS: dict[str, type[_IterationLR]] = {
    c.__name__.lower(): c for c in (WarmupLR, WarmupDecayLR, WarmupCosineLR)
}


def build_scheduler(sched_type: str, params: dict, optimizer: Optimizer) -> LRScheduler:
    """Build the scheduler a DeepSpeed ``scheduler`` config section names (type case-insensitive)."""
    cls = _SCHEDULERS.get(sched_type.lower())
    if cls is None:
        raise ValueError(
            f"scheduler.type {sched_type!r} is not supported; supported: {', '.join(_SUPPORTED_SCHEDULERS)}"
        )
    _reject_unknown("scheduler.params", params, cls)
    return cls(optimizer, **params)
