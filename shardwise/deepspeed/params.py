"""DeepSpeed's live ZeRO-3 parameter and hook surface, as TRL, PEFT and transformers read it.

* ``param.ds_status`` (``ZeroParamStatus``): TRL's fused-loss head gathers ``lm_head.weight`` only
  when it is not ``AVAILABLE``; a stale answer would either compute with a placeholder or release
  a parameter the running forward still needs. So it is a property reading the parameter's group
  now: released -> ``NOT_AVAILABLE``, gather in flight -> ``INFLIGHT``, gathered -> ``AVAILABLE``.
* ``param.ds_active_sub_modules``: the ids of the running modules that gather the parameter now
  (a fresh set each read: TRL's ``clear()`` on it changes nothing, as nothing is recorded there).
* ``module.ds_external_parameters()``: ``(key, parameter)`` pairs of the parameters ``module``
  gathers besides its own (``register_external_parameter``'s, and those shardwise found it reads).
* ``engine.optimizer.parameter_offload``: what ``trl.models.unwrap_model_for_generation`` drives
  around ``generate()`` inside ``GatheredParameters(model.parameters())``: removing
  ``forward_hooks`` makes the stage-3 hooks inert with every parameter gathered (no per-token
  gathers), ``_register_deepspeed_module`` makes them live again, and ``param_coordinator``'s
  ``_invalidate_trace`` makes the next forward record its unit order afresh.

The parameters' class becomes a subclass of their own (``nn.Parameter`` stays true for
``isinstance``) that adds the two properties; nothing else about them changes.
"""

from __future__ import annotations

import enum
import types
from typing import Any

from torch import nn

from shardwise.zero.flat_group import owner_of
from shardwise.zero.gather_state import GatherState


class ZeroParamStatus(enum.Enum):
    """deepspeed.runtime.zero.partition_parameters.ZeroParamStatus."""

    AVAILABLE = 1  # the full parameter is resident
    NOT_AVAILABLE = 2  # only this rank's shard is
    INFLIGHT = 3  # a gather into it is under way


_STATUS = {GatherState.RELEASED: ZeroParamStatus.NOT_AVAILABLE, GatherState.GATHERING: ZeroParamStatus.INFLIGHT,
           GatherState.GATHERED: ZeroParamStatus.AVAILABLE}


class ZeroParameterMixin:
    """What a stage-3 parameter answers besides being a parameter (see the module docstring)."""

    @property
    def ds_status(self) -> ZeroParamStatus:
        group = owner_of(self)
        return ZeroParamStatus.AVAILABLE if group is None else _STATUS[group.state]

    @property
    def ds_active_sub_modules(self) -> set[int]:
        group = owner_of(self)
        fetcher = getattr(group, "fetcher", None)
        if fetcher is None:
            return set()
        return {id(fetcher.units[ui]) for ui in fetcher.stack
                if any(g is group for g in fetcher.groups[ui]) or id(group) in fetcher.external[ui]}


_CLASSES: dict[type, type] = {}


def make_live(p: nn.Parameter) -> bool:
    """Give ``p`` the live properties (a subclass of its own class); False if its class refuses."""
    cls = type(p)
    if issubclass(cls, ZeroParameterMixin):
        return True
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Zero{cls.__name__}", (ZeroParameterMixin, cls), {"__module__": __name__})
    try:
        p.__class__ = _CLASSES[cls]
    except TypeError:  # a parameter class with its own layout: left as it is
        return False
    return True


def _external_parameters(module: nn.Module) -> list[tuple[int, nn.Parameter]]:
    """``module.ds_external_parameters()``: DeepSpeed's ``(id(param), param)`` pairs."""
    found = {id(p): p for p in module.__dict__.get("_shardwise_external", [])}
    groups = [owner_of(p) for p in module.parameters(recurse=False)]
    fetcher = next((g.fetcher for g in groups if getattr(g, "fetcher", None) is not None), None)
    if fetcher is None:  # no parameters of its own (a container): any below it leads to the fetcher
        fetcher = next((g.fetcher for p in module.parameters()
                        if (g := owner_of(p)) is not None and getattr(g, "fetcher", None) is not None), None)
    if fetcher is not None and id(module) in fetcher.unit_of_module:
        for g in fetcher.external[fetcher.unit_of_module[id(module)]].values():
            found.update((id(p), p) for p in g.params)
    return list(found.items())


def add_module_methods(root: nn.Module) -> None:
    """``ds_external_parameters()`` and ``all_parameters()`` on every module, as DeepSpeed adds them."""
    for m in root.modules():
        m.ds_external_parameters = types.MethodType(_external_parameters, m)
        m.all_parameters = types.MethodType(
            lambda self: [*self.named_parameters(recurse=False), *_external_parameters(self)], m)


class _Handle:
    """One entry of ``forward_hooks``: ``remove()`` makes the stage-3 hooks inert."""

    def __init__(self, offload: ParameterOffload):
        self.offload = offload

    def remove(self) -> None:
        self.offload.suspend()


class TraceCoordinator:
    """``parameter_offload.param_coordinator``: the recorded unit order (the prefetch trace)."""

    def __init__(self, fetcher: Any):
        self.fetcher = fetcher

    def is_invalid_trace(self) -> bool:
        return not self.fetcher.order

    def _invalidate_trace(self) -> None:
        """The next forward records the order again (and runs under the released-use check)."""
        if self.is_invalid_trace():
            raise RuntimeError("attempted to invalidate already invalid trace")  # as DeepSpeed
        self.fetcher.order = []
        self.fetcher.check_next = True


class ParameterOffload:
    """``engine.optimizer.parameter_offload`` at ZeRO-3 (DeepSpeed's ``DeepSpeedZeRoOffload``)."""

    def __init__(self, module: nn.Module, fetcher: Any):
        self.module, self.fetcher = module, fetcher
        self.param_coordinator = TraceCoordinator(fetcher)
        self.forward_hooks: list[Any] = [_Handle(self)]
        self.backward_hooks: list[Any] = []
        self._gathered_here: list[Any] = []
        self._guard: Any = None

    def get_param_coordinator(self) -> TraceCoordinator:
        return self.param_coordinator

    def suspend(self) -> None:
        """Hooks inert: every group gathered (those released now are gathered here, and released
        again by ``_register_deepspeed_module``), so forwards compute with the whole model."""
        if self.fetcher.all_gathered:
            return
        groups = [g for gs in self.fetcher.groups for g in gs]
        self._gathered_here = [g for g in groups if not g.is_gathered]
        for g in groups:
            g.gather()
        self.fetcher.all_gathered = True
        self._guard = self.module.register_forward_pre_hook(self._whole_model_check)

    def _whole_model_check(self, _module: nn.Module, _args: Any) -> None:
        """While the hooks are inert every parameter must stay gathered: a forward after a
        ``GatheredParameters`` block released them (hooks never re-added) would read placeholders."""
        released = [g for gs in self.fetcher.groups for g in gs if not g.is_gathered]
        if released:
            raise RuntimeError(
                f"ZeRO-3: the stage-3 hooks were removed (parameter_offload.forward_hooks) and {len(released)} "
                f"parameter groups (e.g. {released[0].names[0]!r}) have been released since; call "
                "engine.optimizer.parameter_offload._register_deepspeed_module(engine.module) (TRL's add_hooks) "
                "before the next forward")

    def _register_deepspeed_module(self, module: nn.Module, count: Any = None) -> None:  # noqa: ARG002
        """Hooks live again (DeepSpeed re-registers them on ``module``, the engine's module)."""
        if module is not self.module:
            raise ValueError("parameter_offload._register_deepspeed_module: shardwise re-arms the hooks of the "
                             "engine's own module only (parameter_offload.module)")
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        if self.fetcher.all_gathered:
            self.fetcher.all_gathered = False
            for g in self._gathered_here:
                g.release()
            self._gathered_here = []
        self.forward_hooks = [_Handle(self)]

    def partition_all_parameters(self) -> None:
        self.fetcher.release_all()


def attach(engine: Any) -> None:
    """The whole surface on a stage-3 engine's model, its parameters and its optimizer."""
    fetcher = getattr(engine, "fetcher", None)
    if fetcher is None:
        return
    for p in engine.module.parameters():
        make_live(p)
    add_module_methods(engine.module)
    if engine.optimizer is not None:
        engine.optimizer.parameter_offload = ParameterOffload(engine.module, fetcher)
