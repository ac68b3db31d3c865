"""Stages 1-2: step the optimizer one bucket at a time, all-gathering each bucket as soon as it is stepped.

``step()`` must return with every rank's range of every parameter updated (code between ``step()``
and the next forward reads ``module.weight`` directly). Stepping the whole optimizer first and then
all-gathering every bucket leaves the wire idle during the optimizer's work and the CPU idle during
the gathers. Here the optimizer steps the buckets in the order the next forward needs them (the
first layers first), each bucket's all-gather starts asynchronously as soon as its shard is stepped,
overlapping the optimizer work of the next bucket, and one wait at the end finishes them all.

A torch optimizer steps every parameter in one ``step()``, so each bucket's step runs the same
optimizer with its ``param_groups`` narrowed, for that call, to the bucket's master alone (a copy of
its group's options). ``state`` stays keyed by the same tensors and ``param_groups`` is the same list
afterwards, so ``state_dict()``, LR schedulers and checkpoints see no difference. This is exact
(bit-identical to one whole step) only for optimizers whose update of a tensor reads nothing but
that tensor, its gradient and state, and its group's options, and whose ``step()`` writes nothing
into the group: torch's own elementwise classes, matched by exact type. Any other optimizer (a
subclass, a client's own class, a whole-tensor mode), or step hooks that would run once per bucket,
keep the one-step path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.optim.optimizer as torch_optimizer
from torch import optim

from shardwise.errors import UserError
from shardwise.zero.elementwise import is_elementwise
from shardwise.zero.low_precision import is_low_precision, step_low_precision

if TYPE_CHECKING:
    from shardwise.zero.builder import Sharding

# Per-tensor updates, per-tensor state (including the step count), nothing written into the group.
ELEMENTWISE_OPTIMIZERS: tuple[type[optim.Optimizer], ...] = (
    optim.SGD, optim.Adam, optim.AdamW, optim.Adagrad, optim.Adamax, optim.Adadelta,
    optim.RMSprop, optim.Rprop, optim.NAdam, optim.RAdam, optim.ASGD,
)

_REPEAT_SAFE = "shardwise_repeat_safe"


def mark_repeat_safe(hook: Callable[..., Any]) -> Callable[..., Any]:
    """Mark an optimizer step hook that may run once per bucket (a check with no side effect)."""
    setattr(hook, _REPEAT_SAFE, True)
    return hook


def _step_hooks(optimizer: optim.Optimizer) -> list[Callable[..., Any]]:
    """Every step pre/post hook that would run at each ``optimizer.step()`` (instance and global)."""
    module = torch_optimizer
    tables = [getattr(optimizer, "_optimizer_step_pre_hooks", {}), getattr(optimizer, "_optimizer_step_post_hooks", {}),
              getattr(module, "_global_optimizer_pre_hooks", {}), getattr(module, "_global_optimizer_post_hooks", {})]
    return [h for table in tables for h in table.values()]


def steps_exactly_per_group(optimizer: optim.Optimizer, subclasses: bool = False) -> bool:
    """May ``optimizer`` step one group's master at a time with the result of one whole step? (A torch
    elementwise class, and step hooks that may run once per group; see the module doc.) ``subclasses``:
    also a subclass of one that keeps its ``step``, and DeepSpeed's own per-element classes
    (``zero/elementwise.py``: their update and state are per tensor, and their ``step`` writes nothing
    into the group): NVMe offload, which has no whole step to fall back on."""
    cls = type(optimizer)
    known = cls in ELEMENTWISE_OPTIMIZERS or (subclasses and is_elementwise(cls) and (
        issubclass(cls, ELEMENTWISE_OPTIMIZERS) or cls.__module__.split(".")[0] == "deepspeed"
        or cls.__module__.startswith("shardwise.deepspeed.")))
    return known and all(getattr(h, _REPEAT_SAFE, False) for h in _step_hooks(optimizer))


def steps_per_bucket(optimizer: optim.Optimizer, sharding: Sharding) -> bool:
    """Whether :func:`step_and_publish` may step ``optimizer`` bucket by bucket (see the module doc)."""
    if sharding.stage not in (1, 2) or len(sharding.groups) < 2:
        return False
    if not steps_exactly_per_group(optimizer):
        return False
    params = [id(p) for pg in optimizer.param_groups for p in pg["params"]]
    masters = {id(g.master) for g in sharding.groups}
    return len(params) == len(set(params)) == len(masters) and masters.issuperset(params)


def require_elementwise(optimizer: optim.Optimizer | None, sharding: Sharding,
                        precision: str) -> optim.Optimizer | None:
    """``optimizer``; with low-precision masters (``<precision>.<precision>_master_weights_and_grads``),
    refused in one line naming that key when their chunked fp32 window (``zero/low_precision.py``) could
    not step it exactly."""
    low = any(is_low_precision(g) for g in sharding.groups)
    if low and optimizer is not None and type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS[:5])
        raise UserError(f"{precision}.{precision}_master_weights_and_grads: a low-precision master is stepped "
                        "by a torch elementwise optimizer "
                        f"({names}, ...); got {type(optimizer).__name__}")
    return optimizer


def step_and_publish(optimizer: optim.Optimizer, sharding: Sharding) -> None:
    """``optimizer.step()`` then ``sharding.publish()``, overlapped per bucket where it is exact.

    Returns with every parameter all-gathered (stages 1-2), as ``publish`` does. Low-precision
    masters step through their fp32 window first (``zero/low_precision.py``)."""
    if any(is_low_precision(g) for g in sharding.groups):
        step_low_precision(optimizer, sharding.groups)
        sharding.publish()
        return
    if not steps_per_bucket(optimizer, sharding):
        optimizer.step()
        sharding.publish()
        return
    group_of = {id(p): pg for pg in optimizer.param_groups for p in pg["params"]}
    whole = optimizer.param_groups
    try:
        with torch.no_grad():
            for g in reversed(sharding.groups):  # the last bucket holds the first layers
                optimizer.param_groups = [{**group_of[id(g.master)], "params": [g.master]}]
                optimizer.step()
                g.publish_master(async_op=True)
    finally:
        optimizer.param_groups = whole
    sharding.wait_for_params()
