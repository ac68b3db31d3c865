"""DeepSpeed's ``safe_get_*`` / ``safe_set_*`` accessors: one parameter's fp32 value, gradient or
optimizer state, whole or this rank's piece, at every ZeRO stage.

A parameter lives in a :class:`~shardwise.zero.flat_group.ShardedGroup`: elements ``[off, off+n)``
of the group's flat buffer, of which this rank owns ``[own_start, own_start+own_numel)`` (all of
it at stage 0). The *local* piece of a parameter is the overlap of the two (possibly empty, 1-D);
the *full* value is assembled from every rank's piece with one all-reduce over the data-parallel
group, so ``safe_get_full_*`` is collective at stages >= 1: every rank calls it for the same
parameter, as with DeepSpeed. ``safe_set_full_*`` is local (every rank passes the same value).

Gradients are reported as the optimizer sees them: averaged over data-parallel ranks and with
the fp16 loss scale removed, once reduced (after the backward of an accumulation boundary, or
any backward at stages >= 2). Before the reduction (inside ``no_sync()`` or an accumulation
window at stages 0-1) it is this rank's own accumulated gradient.
"""

from __future__ import annotations

import torch

from shardwise.zero.flat_group import ShardedGroup, owner_of

__all__ = [
    "safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_grad", "safe_set_full_grad",
    "safe_get_full_optimizer_state", "safe_set_full_optimizer_state", "safe_get_local_fp32_param",
    "safe_set_local_fp32_param", "safe_get_local_grad", "safe_set_local_grad",
    "safe_get_local_optimizer_state", "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized",
]


class _Where:
    """Where parameter ``p`` sits in its group, and the overlap with this rank's owned range."""

    def __init__(self, p: torch.Tensor):
        g = owner_of(p)
        if g is None:
            raise ValueError("this tensor is not a parameter of a shardwise engine (built by initialize)")
        self.g: ShardedGroup = g
        self.p = p
        i = g._index[id(p)]
        self.off, self.n = g.offsets[i], g.numels[i]
        seg = g.layout.segment_of(i, g.own_start, g.own_numel)
        # overlap with the owned range, in flat coordinates
        self.s, self.e = (self.off + seg.start, self.off + seg.stop) if seg is not None else (self.off, self.off)
        ref = getattr(g, "engine_ref", None)
        self.engine = ref() if ref is not None else None

    def piece(self, shard: torch.Tensor) -> torch.Tensor:
        """This param's part of a tensor laid out like the owned range (a view; maybe empty)."""
        if self.s == self.e:
            return shard.narrow(0, 0, 0)
        return shard.narrow(0, self.s - self.g.own_start, self.e - self.s)

    def full(self, shard: torch.Tensor) -> torch.Tensor:
        """Assemble the whole parameter-shaped fp32 tensor from every rank's owned range."""
        out = torch.zeros(self.n, dtype=torch.float32, device=self.g.device)
        out.narrow(0, self.s - self.off, self.e - self.s).copy_(self.piece(shard))
        if self.g.policy.shard_optimizer:
            self.g.comm.all_reduce(out)
        return out.view(getattr(self.p, "ds_shape", self.p.shape))

    def write(self, shard: torch.Tensor, full_value: torch.Tensor) -> None:
        """Copy this rank's part of a whole parameter-shaped value into ``shard``."""
        flat = full_value.detach().reshape(-1)
        if flat.numel() != self.n:
            raise ValueError(f"value has {flat.numel()} elements, the parameter {self.n}")
        self.piece(shard).copy_(flat.narrow(0, self.s - self.off, self.e - self.s))

    def check_local(self, value: torch.Tensor) -> torch.Tensor:
        flat = value.detach().reshape(-1)
        if flat.numel() != self.e - self.s:
            raise ValueError(f"local value has {flat.numel()} elements; this rank's piece of the parameter "
                             f"has {self.e - self.s} (see safe_get_local_fp32_param)")
        return flat

    # -- the tensors behind a parameter --------------------------------------------------
    def param_shard(self) -> torch.Tensor:
        """The fp32 master (trainable) or the stored 16/32-bit shard (frozen), owned range."""
        g = self.g
        if g.master is not None:
            return g.master
        if g.param_shard is not None:
            return g.param_shard
        g.wait_gathered()
        return g.flat_param.narrow(0, g.own_start, g.own_numel)

    def grad_shard(self) -> tuple[torch.Tensor | None, float]:
        """The owned-range gradient and the factor that turns it into the optimizer's gradient."""
        g, eng = self.g, self.engine
        g.wait()
        reduced = g.policy.shard_grads or bool(eng is not None and eng._grads_reduced)
        scale = 1.0 / eng.loss_scaler.scale if eng is not None and eng.loss_scaler is not None else 1.0
        if reduced and getattr(eng, "gradient_average", True):
            scale /= g.comm.size
        if g.policy.shard_grads:
            return (None if g.shard_grad is None and not g.grad_released else g.owned_grad()), scale
        if g.flat_grad is None:
            return None, scale
        return g.flat_grad.narrow(0, g.own_start, g.own_numel), scale

    def state(self, key: str) -> torch.Tensor | None:
        eng = self.engine
        if eng is None or eng.optimizer is None or self.g.master is None:
            return None
        return eng.optimizer.state.get(self.g.master, {}).get(key)

    def sync_low_precision(self) -> None:
        """After the master changed: refresh the compute-dtype copy every rank uses (collective
        at stages 1-2, which all-gather the updated shards)."""
        self.g.wait_gathered()
        self.g.publish_master(async_op=False)
        self.g.wait_gathered()


def _frozen(param: torch.Tensor | None) -> bool:
    """A parameter the optimizer does not train has no fp32 master, gradient or state: None, as
    DeepSpeed's getters answer for it."""
    return isinstance(param, torch.Tensor) and not param.requires_grad


def _unreduced_local_grad(w: _Where) -> bool:
    """Stages 0-1 before the reduction: every rank holds its own whole gradient."""
    eng = w.engine
    return not w.g.policy.shard_grads and not (eng is not None and eng._grads_reduced)


# -- parameters ----------------------------------------------------------------------------
def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 value of ``param`` (the optimizer's master); collective at stages >= 1."""
    if _frozen(param):
        return None
    if owner_of(param) is None:
        return param.detach().float().clone() if param is not None else None
    w = _Where(param)
    return w.full(w.param_shard().float())


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set the whole fp32 value (every rank passes the same ``value``); the compute copy follows."""
    if owner_of(param) is None:
        with torch.no_grad():
            param.copy_(value)
        return
    w = _Where(param)
    g = w.g
    g.wait_gathered()  # a pending all-gather (stages 1-2) would overwrite the new value
    with torch.no_grad():
        w.write(w.param_shard(), value.float())
        shard = g.param_shard  # a 16-bit copy beside the master (not with a MasterStore: the master is it)
        if g.master is not None and not g.master_is_view and shard is not None and shard is not g.master:
            w.write(shard, value)
        if g.is_gathered:
            param.data.copy_(value.reshape(param.shape))


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of the fp32 value (1-D; the whole parameter at stage 0, maybe empty)."""
    if _frozen(param):
        return None
    w = _Where(param)
    return w.piece(w.param_shard()).float().clone()


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's piece; collective at stages 1-2 (the updated shards are all-gathered)."""
    w = _Where(param)
    with torch.no_grad():
        w.piece(w.param_shard()).copy_(w.check_local(value))
        if w.g.master is not None:
            w.sync_low_precision()


# -- gradients -----------------------------------------------------------------------------
def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole gradient the optimizer will step with (see the module docstring); None before
    any backward. Collective at stages >= 1 once reduced."""
    if _frozen(param):
        return None
    if owner_of(param) is None:
        return param.grad
    w = _Where(param)
    shard, scale = w.grad_shard()
    if shard is None:
        return None
    if _unreduced_local_grad(w):
        return w.g.flat_grad.narrow(0, w.off, w.n).float().mul(scale).view(param.shape)
    return w.full(shard.float()).mul_(scale)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace the gradient (same ``value`` on every rank, in the units ``safe_get_full_grad`` uses)."""
    if owner_of(param) is None:
        param.grad = value.clone()
        return
    w = _Where(param)
    shard, scale = w.grad_shard()
    if shard is None:
        raise RuntimeError("safe_set_full_grad before any backward: there is no gradient buffer yet")
    with torch.no_grad():
        if _unreduced_local_grad(w):
            w.g.flat_grad.narrow(0, w.off, w.n).copy_(value.reshape(-1) / scale)
        else:
            w.write(shard, value / scale)


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of the gradient (1-D), in the units of ``safe_get_full_grad``."""
    if _frozen(param):
        return None
    w = _Where(param)
    shard, scale = w.grad_shard()
    return None if shard is None else w.piece(shard).float().mul(scale)


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    w = _Where(param)
    shard, scale = w.grad_shard()
    if shard is None:
        raise RuntimeError("safe_set_local_grad before any backward: there is no gradient buffer yet")
    with torch.no_grad():
        w.piece(shard).copy_(w.check_local(value) / scale)


# -- optimizer state -----------------------------------------------------------------------
def _state_or_raise(w: _Where, key: str) -> torch.Tensor:
    t = w.state(key)
    if t is None:
        raise KeyError(f"optimizer state {key!r} does not exist for this parameter (yet): it appears after "
                       "the first optimizer step; keys of Adam are 'exp_avg' and 'exp_avg_sq'")
    return t


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The whole fp32 optimizer state ``optim_state_key`` of ``param``; collective at stages >= 1."""
    if _frozen(param):
        return None
    w = _Where(param)
    t = w.state(optim_state_key)
    if t is None or t.dim() == 0:
        return t
    return w.full(t.float())


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    w = _Where(param)
    with torch.no_grad():
        w.write(_state_or_raise(w, optim_state_key), value)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    if _frozen(param):
        return None
    w = _Where(param)
    t = w.state(optim_state_key)
    return None if t is None or t.dim() == 0 else w.piece(t).float().clone()


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    w = _Where(param)
    with torch.no_grad():
        w.piece(_state_or_raise(w, optim_state_key)).copy_(w.check_local(value))



def safe_update_full_grad_vectorized(param_list: list[torch.Tensor], update_func) -> None:
    """DeepSpeed's batched gradient edit: each gradient becomes ``update_func(full_grad, param)``.

    Collective as ``safe_get_full_grad`` is (every rank passes the same list); parameters without
    a gradient yet are skipped, as DeepSpeed skips them.
    """
    for p in param_list:
        if not p.requires_grad:
            continue
        grad = safe_get_full_grad(p)
        if grad is not None:
            safe_set_full_grad(p, update_func(grad, p))
