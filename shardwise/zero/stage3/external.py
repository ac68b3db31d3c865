"""Stage 3 parameters used outside the forward of the unit that owns them.

A head that computes ``F.linear(h, self.embed.weight)``, a parent that reads
``self.layers[0].weight``, a model whose layers sit in a container it never calls:
each uses a parameter whose unit is not running, so it would see the released
placeholder. Three mechanisms make that impossible:

* **Attribute reads are tracked** (DeepSpeed tracks them the same way): every module
  holding stage-3 parameters gets a ``_parameters`` dict whose ``__getitem__`` (what
  ``module.weight`` calls) gathers a released parameter when a unit is running, and
  records it as that unit's *external* parameter, so the unit's next forwards and its
  backward gather it with its own groups. Cost: one dict lookup per parameter read.
* **register_external_parameter(module, param)**: DeepSpeed's explicit form, for uses
  that do not go through attribute reads; ``param`` is gathered whenever ``module`` runs.
* **A check of every torch call** (``ReleasedUseCheck``, a ``TorchFunctionMode``) runs
  during the first forwards and the forward after each change of path: an operation
  given a released parameter (reached through a cached reference, which no hook can
  see) raises an error naming the parameter, the unit that used it and the fix. It is
  not left on for every forward because it costs ~15% of a small model's step on CPU.

Outside the model's forward, reading a released parameter returns the placeholder
(its shape is right; see ``GatheredParameters`` for its values).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from shardwise.zero.stage3.parts import FetcherParts


class TrackedParameters(dict):
    """A module's ``_parameters``: reading a released stage-3 parameter in forward gathers it."""

    __slots__ = ()

    def __getitem__(self, name: str) -> nn.Parameter | None:
        p = dict.__getitem__(self, name)
        g = getattr(p, "_shardwise_group", None)
        if g is not None:
            if g.is_gathered:
                g.wait_gathered()  # a prefetch may still be in flight
            elif (f := getattr(g, "fetcher", None)) is not None:
                f.on_access(g)
        return p


def track_access(root: nn.Module) -> None:
    """Swap in :class:`TrackedParameters` on every module that holds a sharded parameter."""
    for m in root.modules():
        params = m.__dict__.get("_parameters")
        if type(params) is dict and any(hasattr(p, "_shardwise_group") for p in params.values()):
            m.__dict__["_parameters"] = TrackedParameters(params)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's API: gather ``parameter`` whenever ``module`` runs (before or after initialize)."""
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"register_external_parameter: expected an nn.Parameter, got {type(parameter).__name__}")
    ext = module.__dict__.setdefault("_shardwise_external", [])
    if not any(p is parameter for p in ext):
        ext.append(parameter)
    if "_shardwise_external_hook" not in module.__dict__:
        module.__dict__["_shardwise_external_hook"] = module.register_forward_pre_hook(_gather_external)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter` (and forget an automatically found use)."""
    ext = module.__dict__.get("_shardwise_external", [])
    module.__dict__["_shardwise_external"] = [p for p in ext if p is not parameter]
    g = getattr(parameter, "_shardwise_group", None)
    if g is not None and getattr(g, "fetcher", None) is not None:
        g.fetcher.forget_external(g)


def _gather_external(module: nn.Module, _args: Any) -> None:
    for p in module.__dict__.get("_shardwise_external", []):
        g = getattr(p, "_shardwise_group", None)
        if g is None:
            continue
        if g.is_gathered:
            g.wait_gathered()
        elif (f := getattr(g, "fetcher", None)) is not None:
            f.on_access(g, module)


class ReleasedParameterError(RuntimeError):
    """A computation was given a released stage-3 parameter that no hook could gather."""


# Tensor metadata that a placeholder answers correctly (shape, dtype, device, ...).
_METADATA = frozenset({"__get__", "size", "dim", "numel", "nelement", "ndimension", "element_size",
                       "is_floating_point", "is_complex", "__len__", "get_device"})


class ReleasedUseCheck(TorchFunctionMode):
    """Raise, naming parameter, user and fix, when a torch call is given a released parameter."""

    def __init__(self, fetcher: FetcherParts):
        super().__init__()
        self.fetcher = fetcher

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in _METADATA:
            for a in itertools.chain(args, kwargs.values()):
                for t in a if isinstance(a, (list, tuple)) else (a,):
                    if isinstance(t, nn.Parameter):
                        self._check(t)
        return func(*args, **kwargs)

    def _check(self, p: nn.Parameter) -> None:
        g = getattr(p, "_shardwise_group", None)
        if g is None or getattr(g, "fetcher", None) is not self.fetcher:
            return
        if g.is_gathered:
            g.wait_gathered()
            return
        if not g.policy.shard_params:
            return
        f = self.fetcher
        user = f.running_name()
        owner = f.unit_names[f.unit_of_group[id(g)]] if id(g) in f.unit_of_group else "?"
        name = next((n for q, n in zip(g.params, g.names, strict=True) if q is p), "?")
        raise ReleasedParameterError(
            f"ZeRO-3: parameter {name!r} (sharded with unit {owner!r}) was used in the forward of "
            f"{user!r} while released (only this rank's shard is resident). It was reached through a "
            "reference that bypasses module attribute access (a tensor kept in a list, dict or "
            "closure), which shardwise cannot see to gather it. Fix: call "
            f"shardwise.zero.register_external_parameter(<module {user!r}>, <parameter {name!r}>) "
            "once after building the model, or read it as module.attribute inside forward")


def is_released(t: torch.Tensor) -> bool:
    """True for a stage-3 parameter whose full value is not resident now."""
    g = getattr(t, "_shardwise_group", None)
    return g is not None and not g.is_gathered
