"""DeepSpeed's checks on how an engine is used: unused parameters, checkpoint tags and folders.

Each raises where DeepSpeed raises (with :class:`UsageError`, an
AssertionError, where DeepSpeed asserts), so scripts and tests written for DeepSpeed see the same
failure, with a message that names the fix.
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from shardwise.comm import compute_device
from shardwise.errors import UsageError
from shardwise.zero.bucket_step import mark_repeat_safe

if TYPE_CHECKING:
    from shardwise.engine.parts import EngineParts

log = logging.getLogger("shardwise")

TAG_MODES = ("ignore", "warn", "fail")


class UsedParams:
    """Which tracked parameters received a gradient in the current accumulation window."""

    def __init__(self, tracked: dict[str, torch.nn.Parameter]):
        self.tracked, self.used = tracked, set()
        self.hooks = [p.register_post_accumulate_grad_hook(self._seen) for p in tracked.values()]

    def _seen(self, p: torch.Tensor) -> None:
        self.used.add(id(p))

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


_USED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> UsedParams


def used_params_of(engine: EngineParts) -> UsedParams | None:
    """The engine's unused-parameter tracking, None when it does not track (the one accessor)."""
    return _USED.get(engine)


def track_used(engine: EngineParts) -> None:
    """With ``zero_optimization.ignore_unused_parameters: false`` at stage >= 2, record which
    trainable parameters receive a gradient in the current accumulation window."""
    if engine.zero_ignore_unused_parameters() or not engine.policy.shard_grads or engine in _USED:
        return
    names = {id(p): n for n, p in engine.module.named_parameters()}
    _USED[engine] = UsedParams({names[id(p)]: p for g in engine.groups for p in g.params})


def check_all_used(engine: EngineParts) -> None:
    """At the step: refuse when a trainable parameter got no gradient in the window (DeepSpeed
    asserts the same at stages 1-2 with ``ignore_unused_parameters: false``)."""
    tracking = _USED.get(engine)
    if tracking is None:
        return
    missing = [n for n, p in tracking.tracked.items() if id(p) not in tracking.used]
    tracking.used.clear()
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UsageError(f"parameter {missing[0]!r}{more} got no gradient: it was not used in producing the "
                         "loss. Set zero_optimization.ignore_unused_parameters: true (the default) to step "
                         "it with a zero gradient, or make every trainable parameter take part in the loss")


def _tag_digest(tag: str) -> torch.Tensor:
    h = hashlib.sha256(tag.encode()).digest()[:7]
    # on the collectives' device: NCCL all-reduces no host tensor
    return torch.tensor([int.from_bytes(h, "little")], dtype=torch.int64, device=compute_device())


def check_save_args(engine: EngineParts, save_dir, tag: str | None) -> str | None:
    """Refuse an empty ``save_dir``; check that every rank passed the same ``tag``.

    ``checkpoint.tag_validation`` ("Ignore" | "Warn" | "Fail", default "Warn", as DeepSpeed):
    with "Fail" differing tags raise; otherwise a warning is logged and every rank saves under
    rank 0's tag, since one sharded checkpoint has one folder. Returns the tag to use.
    """
    if save_dir is None or str(save_dir) == "":
        raise ValueError(f"save_checkpoint(save_dir={save_dir!r}): save_dir must name a folder")
    mode = str(engine.config.checkpoint.get("tag_validation", "Warn")).lower()
    if mode not in TAG_MODES:
        raise ValueError(f"checkpoint.tag_validation {mode!r} is not one of Ignore, Warn, Fail")
    from shardwise.checkpoint.fileio import world_comm

    comm = world_comm()
    if comm.size == 1:
        return tag
    mine = _tag_digest(str(tag))
    lo, hi = mine.clone(), mine.clone()
    comm.all_reduce(lo, op=torch.distributed.ReduceOp.MIN)
    comm.all_reduce(hi, op=torch.distributed.ReduceOp.MAX)
    if bool(lo == hi):
        return tag
    msg = (f"save_checkpoint: tag {tag!r} on rank {comm.rank} differs from another rank's; every rank must "
           "pass the same tag (one checkpoint folder holds every rank's shard)")
    if mode == "fail":
        raise UsageError(msg + " (checkpoint.tag_validation: Fail)")
    box = [tag]
    comm.broadcast_object_list(box, src=0)
    if comm.rank == 0 or mode == "warn":
        log.warning(msg + f"; saving under rank 0's tag {box[0]!r}")
    return box[0]


def direct_step_guard(engine: EngineParts) -> Callable[..., None]:
    """The step pre-hook that refuses a direct ``optimizer.step()``, made before ZeRO shards (the engine
    registers it on the optimizer ``initialize`` returns, once that exists).

    That optimizer steps the engine's shards; stepping it directly would skip the reduction wait,
    unscaling, clipping and the all-gather of the result (a silent no-op or a wrong step), so it is
    refused with the fix. The engine's own step sets ``_engine_stepping``."""
    ref = weakref.ref(engine)

    def pre_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:  # noqa: ARG001
        e = ref()
        if e is not None and not e.__dict__.get("_engine_stepping", False):
            raise UsageError("optimizer.step() called directly: call engine.step() after engine.backward(); it "
                             "waits for the gradient reduction, unscales, clips, steps this optimizer and the "
                             "lr scheduler, and shares the updated parameters")

    return mark_repeat_safe(pre_step)  # a check: may run once per bucket
