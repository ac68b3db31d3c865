"""``engine.offload_states()`` / ``engine.reload_states()`` (DeepSpeed 0.16+): free the accelerator's memory
between an RL loop's generation and its training, then put everything back exactly.

What moves, by DeepSpeed's ``OffloadStateTypeEnum`` names (``include``; None: all of them):

* ``optim_states``: every tensor of the optimizer's state;
* ``hp_params``: the fp32 (or 16-bit) masters that are tensors of their own (not views of the parameters);
* ``lp_params``: the parameters' flat buffers (stages 0-2) and the persistent stage-3 shards;
* ``lp_grads``: the gradient buffers (the flat gradient at stages 0-1, the reduced shard at stages >= 2);
* ``contiguous_grad_buffer``: the finished gradient buckets kept for reuse (stages >= 2): dropped, not
  copied (they hold no value), made again by the next backward.

Each storage is copied to a host buffer (pinned with ``pin_memory`` on an accelerator) and resized to zero
bytes, so every view of it (the parameters of a flat buffer, ``param.grad``) stays the same object and sees
its bytes again after ``reload_states()``; the next step is then bit-equal to one never offloaded. A
storage already on ``device`` does not move. While offloaded, a forward or a step raises (a hook that
``reload_states`` removes) instead of reading freed memory. ``non_blocking`` is accepted; the copies
are fenced before device memory is released, as a read of a freed storage would be garbage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from shardwise.errors import UsageError
from shardwise.zero.bucket_step import mark_repeat_safe

if TYPE_CHECKING:
    from shardwise.engine.parts import EngineParts

KINDS = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")
REPORT_KEY = {"optim_states": "optimizer_states", "hp_params": "master_params", "lp_params": "params",
              "lp_grads": "grads", "contiguous_grad_buffer": "comm_buffers"}


@dataclass
class Offloaded:
    """What ``offload_states`` moved: (storage, host copy) per kind, and the hooks that guard use."""

    moved: dict[str, list[tuple[torch.UntypedStorage, torch.Tensor]]] = field(default_factory=dict)
    hooks: list[Any] = field(default_factory=list)
    # bytes memory_report() still counts by shape (a flat parameter buffer it counts by its live storage)
    counted: dict[str, int] = field(default_factory=dict)

    def nbytes(self, kind: str) -> int:
        return sum(host.numel() for _, host in self.moved.get(kind, []))


def _groups(engine: EngineParts) -> list[Any]:
    return list(engine.groups) + [g for gs in engine.unit_groups for g in gs if g not in engine.groups]


def _tensors(engine: EngineParts, kind: str) -> list[torch.Tensor]:
    groups = _groups(engine)
    if kind == "optim_states":
        opt = engine.optimizer
        return [v for st in (opt.state.values() if opt is not None else ()) for v in st.values() if torch.is_tensor(v)]
    if kind == "hp_params":
        return [g.master for g in groups if g.master is not None and not g.master_is_view]
    if kind == "lp_params":
        return [t for g in groups for t in (g.flat_param, g.store.shard) if t is not None]
    if kind == "lp_grads":
        return [t for g in groups for t in (g.flat_grad, g.shard_grad) if t is not None]
    return []


def _uint8(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _refuse(*_args: Any, **_kwargs: Any) -> None:
    raise UsageError("the engine's states are offloaded (engine.offload_states()); call engine.reload_states() "
                     "before the next forward or step")


def offload_states(engine: EngineParts, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
                   non_blocking: bool = False, move_host: bool = False) -> Offloaded:  # noqa: ARG001
    """Move the states named in ``include`` to ``device`` (only "cpu"); ``move_host``: host storages too (the
    CPU-only test path: freed and restored the same way)."""
    if getattr(engine, "offloaded_states", None) is not None:
        raise UsageError("engine.offload_states(): the states are offloaded already; reload_states() first")
    if str(getattr(device, "value", device)) != "cpu":
        raise UsageError(f"engine.offload_states(device={device!r}): states are offloaded to the CPU only")
    kinds = [str(getattr(k, "value", k)) for k in (include if include is not None else KINDS)]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise UsageError(f"engine.offload_states(include=...): {unknown[0]!r} is not one of {', '.join(KINDS)}")
    engine.wait_for_params()
    out, seen = Offloaded(), set()
    for kind in kinds:
        if kind == "contiguous_grad_buffer":
            _drop_free_buckets(engine)
            continue
        for t in _tensors(engine, kind):
            st = t.untyped_storage()
            key = (st.device, st.data_ptr())
            if key in seen or st.nbytes() == 0 or (st.device.type == "cpu" and not move_host):
                continue
            seen.add(key)
            host = torch.empty(st.nbytes(), dtype=torch.uint8,
                               pin_memory=pin_memory and st.device.type != "cpu" and torch.cuda.is_available())
            host.copy_(_uint8(st))  # blocking: the host buffer holds the bytes before the storage goes
            st.resize_(0)
            out.moved.setdefault(kind, []).append((st, host))
            live = kind == "lp_params" and any(t is g.flat_param for g in _groups(engine))
            out.counted[kind] = out.counted.get(kind, 0) + (0 if live else st.nbytes() or host.numel())
    out.hooks = [engine.module.register_forward_pre_hook(_refuse)]
    if engine.optimizer is not None:
        out.hooks.append(engine.optimizer.register_step_pre_hook(mark_repeat_safe(_refuse)))
    engine.offloaded_states = out
    return out


def reload_states(engine: EngineParts, non_blocking: bool = False) -> None:  # noqa: ARG001
    """Put back what :func:`offload_states` moved (each storage its old size, its bytes copied in)."""
    out: Offloaded | None = getattr(engine, "offloaded_states", None)
    if out is None:
        return
    for pairs in out.moved.values():
        for st, host in pairs:
            st.resize_(host.numel())
            _uint8(st).copy_(host)
    for h in out.hooks:
        h.remove()
    engine.offloaded_states = None


def _drop_free_buckets(engine: EngineParts) -> None:
    """The finished gradient buckets kept for reuse hold no value: let them go (made again when needed)."""
    for g in engine.groups:
        if g.inflight is not None:
            g.inflight.settle()  # nothing is pending between steps: this lets the free buckets go


def offload_memory(engine: EngineParts, rep: dict[str, int]) -> None:
    """``memory_report()``: what ``offload_states`` moved is counted out of its kind and shown apart."""
    out: Offloaded | None = getattr(engine, "offloaded_states", None)
    if out is None:
        return
    for kind, nbytes in out.counted.items():
        rep[REPORT_KEY[kind]] -= nbytes
    rep["offloaded_states"] = sum(out.nbytes(k) for k in out.moved)
