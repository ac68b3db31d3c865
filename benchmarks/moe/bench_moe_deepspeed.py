"""DeepSpeed's side of ``bench_moe.py``: its engine (AutoEP or not) and its tensor bytes per rank.

Imported only in the interpreter that has ``deepspeed`` (``--ds-python``). Two facts a reader needs:

* **The one patch.** DeepSpeed 0.19.8's AutoEP, while it swaps the MoE blocks in, re-targets
  transformers' output recorders (``router_logits``) through
  ``transformers.utils.output_capturing._CAN_RECORD_REGISTRY``, treating it as a plain dict keyed by
  the class name: ``registry.get(key, default)`` and ``registry[key] = entry``. In transformers 5.24
  that registry is a ``dict`` subclass whose ``get(model)`` takes a *model* (one argument) and whose
  ``__setitem__`` keys by ``str(model.__class__)``, so ``deepspeed.initialize`` with an
  ``expert_parallel`` section dies with ``TypeError: _CanRecordRegistry.get() takes 2 positional
  arguments but 3 were given``. ``patch_can_record_registry`` lets both calling conventions through:
  a ``str`` key is used as the dict key as it is (with the default), anything else is treated as
  transformers treats it. Nothing else is patched; it is applied in this benchmark's DeepSpeed
  process only.
* **What is counted.** The same tensors ``engine.memory_report()`` counts for shardwise, found on
  DeepSpeed's objects: the module's parameters (views into ZeRO's flat buffers: each storage once),
  gradients (``.grad`` of the parameters and of the fp32 partitions, and every optimizer attribute
  whose name says grad / ipg: averaged gradients, the contiguous-gradient buffers), fp32 masters
  (``single_partition_of_fp32_groups``: a copy even in fp32 training) and the inner optimizer's
  state (tensors of more than one element). Every storage counted once, by its data pointer.
"""

from __future__ import annotations

from typing import Any

import torch


def patch_can_record_registry() -> str:
    """Make transformers' output-capture registry accept DeepSpeed's dict-style calls (see above).
    Returns what was done, for the results file."""
    from transformers.utils import output_capturing as oc

    cls = type(getattr(oc, "_CAN_RECORD_REGISTRY", None))
    if getattr(cls, "_bench_patched", None):
        return cls._bench_patched
    if cls is dict or not issubclass(cls, dict):
        return "not needed"
    model_get, model_set = cls.get, cls.__setitem__

    def get(self: dict, key: Any, *default: Any) -> Any:
        return dict.get(self, key, *default) if isinstance(key, str) else model_get(self, key)

    def setitem(self: dict, key: Any, value: Any) -> None:
        dict.__setitem__(self, key, value) if isinstance(key, str) else model_set(self, key, value)

    cls.get, cls.__setitem__ = get, setitem
    cls._bench_patched = (f"{cls.__module__}.{cls.__name__}.get/__setitem__ also take a str key (DeepSpeed's "
                          "dict-style calls); model keys unchanged")
    return cls._bench_patched


def build_engine(model: torch.nn.Module, cfg: dict) -> Any:
    import deepspeed

    if "expert_parallel" in cfg:
        patch_can_record_registry()
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    return engine


class _Storages:
    """Tensor bytes by kind, each storage counted once (views into ZeRO's flat buffers included)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = {"params": 0, "grads": 0, "master_params": 0, "optimizer_states": 0}

    def add(self, kind: str, obj: Any, depth: int = 0) -> None:
        if torch.is_tensor(obj):
            s = obj.untyped_storage()
            if s.nbytes() and s.data_ptr() not in self.seen:
                self.seen.add(s.data_ptr())
                self.bytes[kind] += s.nbytes()
        elif isinstance(obj, (list, tuple)) and depth < 3:
            for x in obj:
                self.add(kind, x, depth + 1)
        elif isinstance(obj, dict) and depth < 3:
            for x in obj.values():
                self.add(kind, x, depth + 1)


def memory(engine: Any) -> dict[str, int]:
    """This rank's tensor bytes of ``engine`` by kind (the module docstring says which tensors)."""
    acc = _Storages()
    for p in engine.module.parameters():
        acc.add("params", p.data)
    opt = engine.optimizer
    masters = getattr(opt, "single_partition_of_fp32_groups", None) or []
    for p in engine.module.parameters():
        acc.add("grads", p.grad)
    for m in masters:
        acc.add("grads", m.grad)
    for name, v in vars(opt).items():
        if "grad" in name or "ipg" in name:
            acc.add("grads", v)
    acc.add("master_params", masters)
    inner = getattr(opt, "optimizer", opt)
    for state in inner.state.values():
        acc.add("optimizer_states", [v for v in state.values() if torch.is_tensor(v) and v.numel() > 1])
    return acc.bytes


def expert_bytes(engine: Any) -> int:
    """The experts' bytes on this rank: their parameters (and ``.grad``), and per ZeRO group their
    share (by elements) of the group's fp32 partition, its gradient partition (``averaged_gradients``
    between backward and step) and its optimizer state."""
    names = {id(p): n for n, p in engine.module.named_parameters()}
    total = 0
    for p in engine.module.parameters():
        if ".experts." in names[id(p)]:
            total += p.numel() * p.element_size() * (2 if p.grad is not None else 1)
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    averaged = getattr(opt, "averaged_gradients", None) or {}
    for i, (group, master) in enumerate(zip(opt.bit16_groups, opt.single_partition_of_fp32_groups, strict=True)):
        share = sum(p.numel() for p in group if ".experts." in names.get(id(p), "")) / sum(p.numel() for p in group)
        state = inner.state.get(master, {})
        grads = [master.grad] if master.grad is not None else list(averaged.get(i) or [])  # before step: partitions
        held = [master, *grads, *(v for v in state.values() if torch.is_tensor(v) and v.numel() > 1)]
        total += int(share * sum(t.numel() * t.element_size() for t in held if t is not None))
    return total
