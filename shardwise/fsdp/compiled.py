"""``torch.compile`` of a sharded model: ``shardwise.compile(model)`` and ``engine.compile()``.

Stages 0-2 compile the whole model (``nn.Module.compile``): their parameters stay whole, and the
only sharding hook dynamo meets is the root's post-forward hook, kept eager
(``zero/eager_hooks.py``), after the last graph. Stage 3 compiles each unit's ``forward`` (each
decoder layer: regional compilation) and leaves the root's code eager: the units' gather / release
hooks run in ``nn.Module.__call__`` around the compiled forward, so no graph ever sees a released
(NaN placeholder) parameter or a ``param.data`` swap, and the layers' graphs have no breaks. Tracing
a whole stage-3 model (``torch.compile(model)``, ``model.compile()``) also works, equal to eager,
but breaks the graph at every unit's hooks (``zero/eager_hooks.py``); this function avoids them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.zero.builder import Sharding


def compile_sharded(model: nn.Module, sharding: Sharding, backend: Any = "inductor",
                    compile_kwargs: dict | None = None) -> nn.Module:
    """Compile ``model`` (sharded by ``sharding``) in place for its stage; returns it."""
    kwargs = dict(compile_kwargs or {})
    if not sharding.policy.shard_params:
        model.compile(backend=backend, **kwargs)
        return model
    for unit in sharding.units[:-1]:  # the root (last) keeps its code eager
        unit.forward = torch.compile(unit.forward, backend=backend, **kwargs)
    return model


def compile(model: nn.Module, backend: Any = "inductor", **compile_kwargs: Any) -> nn.Module:  # noqa: A001
    """``torch.compile`` for a ``shardwise.shard``-ed model, at any stage (in place; returns it)."""
    sharding = getattr(model, "sharding", None)
    if not isinstance(sharding, Sharding):
        raise TypeError("shardwise.compile(model): model is not sharded; call shardwise.shard(model, ...) first "
                        "(or torch.compile an unsharded model directly)")
    return compile_sharded(model, sharding, backend, compile_kwargs)
