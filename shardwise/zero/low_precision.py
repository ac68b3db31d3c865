"""DeepSpeed's low-precision masters: the optimizer steps a bf16/fp16 master through an fp32 window.

With ``bf16.bf16_master_weights_and_grads`` (or ``fp16.fp16_master_weights_and_grads``) a group's master
is the shard of its bf16/fp16 parameters itself (no second copy on the device; a CPU copy with optimizer
offload) and its gradient the reduced bf16/fp16 shard. The optimizer state is bf16 with
``bf16.bf16_optimizer_states``, else fp32 (fp16 masters always keep fp32 states, as DeepSpeed does).

A torch optimizer run directly on a bf16 tensor rounds every update to the nearest bf16 value and
loses any update smaller than half a bf16 ulp of the weight (2^-9 relative): with a learning rate of
1e-4 most of Adam's updates vanish. So the step runs here, chunk by chunk (``CHUNK`` elements, the only
fp32 memory it adds, transient), on an fp32 *window*: the master (plus the compensation, below) and the
state upcast to fp32, the optimizer stepped on the window, then the window rounded back:

* ``nearest``: round to nearest (what a bf16 optimizer does; the memory floor);
* ``kahan`` (default): a compensation buffer in the master's dtype keeps ``window - rounded`` and is
  added back before the next step, so the master plus its compensation carries ~16 bits of mantissa
  and small updates accumulate instead of vanishing (2 bytes per parameter more);
* ``stochastic`` (bf16 only): the fp32 window is rounded up or down with probability proportional to
  its distance (random low 16 bits added, then truncated), so updates are right in expectation.

The chunked step narrows ``param_groups`` to one window and hands the optimizer that window's slice
of the state, the same trick as ``bucket_step.py``; it is exact (the same update as one whole step in
fp32) for torch's elementwise optimizers only, so the engine refuses any other with these keys
(``bucket_step.require_elementwise``). The
compensation lives in the optimizer state under :data:`COMPENSATION` so checkpoints save and reshard
it like the moments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import optim

if TYPE_CHECKING:
    from shardwise.zero.flat_group import ShardedGroup

COMPENSATION = "shardwise_compensation"  # the Kahan buffer's key in the optimizer state
CHUNK = 1 << 22  # elements per fp32 window: 4M x (4 + 4 + 8) bytes = 64 MiB transient at most
UPDATES = ("nearest", "kahan", "stochastic")


def is_low_precision(g: ShardedGroup) -> bool:
    """Does this group's optimizer step a bf16/fp16 master (through the fp32 window)?"""
    return g.master is not None and g.master.dtype != torch.float32


def kept_state_dtype(g: ShardedGroup, key: str) -> torch.dtype | None:
    """The dtype ``g``'s optimizer keeps per-element state ``key`` in, so a checkpoint of any master mode
    loads into any other (converted on read); None: a Kahan compensation ``g`` does not keep."""
    if key == COMPENSATION:
        keeps = g.master is not None and is_low_precision(g) and g.precision.master_update == "kahan"
        return g.master.dtype if keeps else None
    return g.precision.state_dtype if is_low_precision(g) else g.master.dtype


def master_buffer(g: ShardedGroup, saved: torch.dtype) -> torch.Tensor:
    """What a checkpoint's master is read into: a copy of the live master, or fp32 when fp32 masters load
    into a Kahan 16-bit master (:func:`settle_master` then keeps what the rounding drops)."""
    if saved == torch.float32 and kept_state_dtype(g, COMPENSATION) is not None:
        return g.master.detach().float()
    return g.master.detach().clone()


def settle_master(g: ShardedGroup, bufs: dict[str, torch.Tensor], with_states: bool) -> None:
    """An fp32 master read for a Kahan 16-bit one: rounded, the residual its compensation (with states)."""
    wide = bufs["master"]
    if wide.dtype != g.master.dtype:
        bufs["master"] = wide.to(g.master.dtype)
        if with_states:
            bufs[COMPENSATION] = wide.sub_(bufs["master"].float()).to(g.master.dtype)


def round_stochastic(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16 rounded up or down with probability proportional to the distance (exact in expectation):
    random low 16 bits added to the fp32 bit pattern, then truncated (a bf16 is fp32's top 16 bits)."""
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=gen)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


def _seed(step: Any, rank: int, index: int, start: int) -> int:
    """A seed per (step, rank, group, chunk): reproducible, and the same after a resume."""
    s = int(step) if step is not None else 0
    return (s * 1_000_003 + rank * 7_919 + index * 104_729 + start) % (1 << 62)


def _window_state(before: dict[str, Any], numel: int, a: int, b: int) -> dict[str, Any]:
    """The optimizer state of one window: the shard-shaped tensors' slice in fp32, the rest as they were."""
    out: dict[str, Any] = {}
    for k, v in before.items():
        if k == COMPENSATION:
            continue
        if torch.is_tensor(v) and v.dim() == 1 and v.numel() == numel:
            out[k] = v[a:b].to(torch.float32, copy=True)
        else:
            out[k] = v.clone() if torch.is_tensor(v) else v
    return out


def _store_window(state: dict[str, Any], new: dict[str, Any], numel: int, a: int, b: int,
                  state_dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Write a window's stepped state back into the shard-shaped state; returns its other (scalar) entries."""
    scalars = {}
    for k, v in new.items():
        if torch.is_tensor(v) and v.dim() == 1 and v.numel() == b - a:  # (Adam's step has shape ())
            full = state.get(k)
            if not (torch.is_tensor(full) and full.numel() == numel and full.dtype == state_dtype):
                full = torch.zeros(numel, dtype=state_dtype, device=device)
                state[k] = full
            full[a:b].copy_(v)
        else:
            scalars[k] = v
    return scalars


def step_group(optimizer: optim.Optimizer, g: ShardedGroup, options: dict[str, Any], index: int) -> None:
    """Step ``g``'s low-precision master window by window (see the module doc); ``options`` is its
    param group's options."""
    m, prec = g.master, g.precision
    n, rule = m.numel(), prec.master_update
    state = optimizer.state[m]
    before = dict(state)
    comp = state.get(COMPENSATION) if rule == "kahan" else None
    if rule == "kahan" and not (torch.is_tensor(comp) and comp.numel() == n and comp.dtype == m.dtype):
        comp = torch.zeros(n, dtype=m.dtype, device=m.device)
        state[COMPENSATION] = comp
    elif rule != "kahan":
        state.pop(COMPENSATION, None)
    grad = m.grad
    gen = torch.Generator(device=m.device) if rule == "stochastic" else None
    scalars: dict[str, Any] = {}
    whole = optimizer.param_groups
    try:
        for a in range(0, n, CHUNK):
            b = min(n, a + CHUNK)
            w = m[a:b].to(torch.float32, copy=True)
            if comp is not None:
                w.add_(comp[a:b])
            w.grad = grad[a:b].to(torch.float32, copy=True) if grad is not None else None
            optimizer.state[w] = _window_state(before, n, a, b)
            optimizer.param_groups = [{**options, "params": [w]}]
            optimizer.step()
            scalars = _store_window(state, optimizer.state.pop(w), n, a, b, prec.state_dtype, m.device)
            if gen is not None:
                gen.manual_seed(_seed(before.get("step"), g.comm.rank, index, a))
                rounded = round_stochastic(w, gen)
            else:
                rounded = w.to(m.dtype)
            if comp is not None:
                comp[a:b].copy_(w.sub_(rounded.to(torch.float32)))
            m[a:b].copy_(rounded)
    finally:
        optimizer.param_groups = whole
    state.update(scalars)


def step_low_precision(optimizer: optim.Optimizer, groups: list[ShardedGroup]) -> None:
    """Step every group: low-precision masters through the fp32 window, fp32 masters as they are
    (each with its param group's options narrowed to it, as ``bucket_step.py`` does)."""
    group_of = {id(p): pg for pg in optimizer.param_groups for p in pg["params"]}
    whole = optimizer.param_groups
    with torch.no_grad():
        for i, g in enumerate(groups):
            if g.master is None or id(g.master) not in group_of:
                continue
            options = {k: v for k, v in group_of[id(g.master)].items() if k != "params"}
            if is_low_precision(g):
                step_group(optimizer, g, options, i)
                continue
            try:
                optimizer.param_groups = [{**options, "params": [g.master]}]
                optimizer.step()
            finally:
                optimizer.param_groups = whole
