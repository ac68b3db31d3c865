"""Any ``torch.optim`` optimizer on a sharded model's shards, and gradient clipping over them.

:class:`ShardedOptimizer` builds ``optimizer_class`` over the groups' fp32 master shards (this
rank's 1/N at stages >= 1), so the plain loop ``loss.backward(); opt.step(); opt.zero_grad()``
steps exactly what the engine steps: it waits for the gradient reductions, averages over the
data-parallel ranks, steps, and writes the updated shards back into the parameters (stages 1-2
all-gather them before ``step()`` returns). It is a ``torch.optim.Optimizer`` whose
``param_groups`` and ``state`` are the inner optimizer's, so LR schedulers work on it. An optimizer
that is not elementwise (Adafactor, Muon, a user's class; ``zero/elementwise.py``) is built over whole
tensors instead, each owned by one rank (``zero/whole_tensor.py``, ``docs/optimizers.md``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shardwise.fsdp.module import sharding_of
from shardwise.zero.bucket_step import step_and_publish
from shardwise.zero.builder import Sharding
from shardwise.zero.elementwise import is_elementwise
from shardwise.zero.whole_tensor import WholeTensorStepper


def _prepared(sharding: Sharding) -> list[torch.Tensor]:
    """The reduced, rank-averaged master gradients of this step (attached once per step)."""
    grads = getattr(sharding, "step_grads", None)
    if grads is None:
        grads = sharding.reduced_grads(1.0 / sharding.dp_world)
        sharding.step_grads = grads
    return grads


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of a sharded model to ``max_norm``; returns the total norm before clipping.

    As ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` on the unsharded model: the
    norm is taken over every rank's shards (and TP slices), so every rank gets the same value.
    Call it after the last backward of the step and before ``opt.step()``.
    """
    if norm_type != 2.0:
        raise NotImplementedError(f"clip_grad_norm_(norm_type={norm_type}): only the 2-norm is implemented")
    sharding = sharding_of(model)
    grads = _prepared(sharding)
    norm = sharding.grad_norm(grads)
    if error_if_nonfinite and not math.isfinite(norm):
        raise RuntimeError(f"the total norm of the gradients is {norm}: non-finite, so it cannot be clipped "
                           "(pass error_if_nonfinite=False to clip anyway)")
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)
    # on the grads' device, as torch's clip_grad_norm_ returns it (the float is host-side already)
    return torch.tensor(norm, device=grads[0].device if grads else None)


def _master_groups(sharding: Sharding, param_groups: list[dict] | None, defaults: dict) -> list[dict]:
    """One optimizer group per shard-time param group, or the user's ``param_groups`` mapped onto
    the buckets (each bucket must fall inside one of them)."""
    if param_groups is None:
        return [{**defaults, **opts, "params": [g.master for g in gs]}
                for opts, gs in zip(sharding.param_groups, sharding.groups_by_pg, strict=True)]
    names = {id(p): n for n, p in sharding.module.named_parameters()}
    where = {id(p): i for i, pg in enumerate(param_groups) for p in pg["params"]}
    out = [{**defaults, **{k: v for k, v in pg.items() if k != "params"}, "params": []} for pg in param_groups]
    for g in sharding.groups:
        idx = {where.get(id(p)) for p in g.params}
        if len(idx) != 1 or None in idx:
            bad = next(p for p in g.params if where.get(id(p)) != where.get(id(g.params[0])) or id(p) not in where)
            raise ValueError(f"ShardedOptimizer(param_groups=...): parameter {names[id(bad)]!r} shares a bucket "
                             "with parameters of another group (or of none); pass the same param_groups to "
                             "shardwise.shard(model, param_groups=...) so the buckets follow them")
        out[idx.pop()]["params"].append(g.master)
    return [pg for pg in out if pg["params"]]


class ShardedOptimizer(torch.optim.Optimizer):
    """``ShardedOptimizer(model, torch.optim.AdamW, lr=1e-3)``: ``optimizer_class`` on the shards."""

    def __init__(self, model: nn.Module, optimizer_class: type[torch.optim.Optimizer],
                 param_groups: Iterable[dict] | None = None, **defaults: Any):
        self.sharding = sharding_of(model)
        user = list(param_groups) if param_groups is not None else None
        whole = None
        if is_elementwise(optimizer_class):
            groups = _master_groups(self.sharding, user, {})
        else:  # steps whole tensors: zero/whole_tensor.py
            whole = WholeTensorStepper(self.sharding, optimizer_class.__name__)
            groups = (whole.from_param_groups(user, {}) if user is not None
                      else whole.from_master_groups(_master_groups(self.sharding, None, {})))
        if not groups:
            raise ValueError("ShardedOptimizer: the model has no trainable parameters to optimize")
        self.optimizer = optimizer_class(groups, **defaults)
        if whole is not None:
            whole.attach(self.optimizer)
        super().__init__(groups, self.optimizer.defaults)
        self.param_groups = self.optimizer.param_groups  # one set of groups: schedulers edit the inner's
        self.state = self.optimizer.state
        self.global_steps = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Wait for the reductions, average over ranks, step the shards, share the result."""
        if closure is not None:
            raise NotImplementedError("ShardedOptimizer.step(closure): closures would rerun a sharded "
                                      "forward and backward; call them before step()")
        sh = self.sharding
        _prepared(sh)
        step_and_publish(self.optimizer, sh)  # stages 1-2: all-gathered bucket by bucket, done on return
        sh.step_grads = None
        self.global_steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - the buckets are zeroed either way
        """Zero the gradient buckets (required before the next step's backwards, as in torch)."""
        self.sharding.step_grads = None
        self.sharding.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (see ``shardwise.save_checkpoint`` for files)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state
