"""DeepSpeed's LR schedules, with its exact formulas, as torch ``LRScheduler``s.

``build_scheduler`` makes the one a config's ``scheduler`` section names; the facade serves these
classes as ``deepspeed.runtime.lr_schedules``. Each counts DeepSpeed's ``last_batch_iteration``
(one per optimizer step), so a resumed run continues the schedule where it stopped.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from shardwise.config.schema import SCHEDULERS as CONFIG_SCHEDULERS
from shardwise.optim.optimizers import reject_unknown

__all__ = ["build_scheduler", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]

_SUPPORTED_SCHEDULERS = tuple(CONFIG_SCHEDULERS)


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
    reject_unknown("scheduler.params", params, cls)
    return cls(optimizer, **params)
