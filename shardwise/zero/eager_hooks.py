"""Sharding hooks stay eager under ``torch.compile``.

The hooks that gather, release and wait for parameters change ``param.data`` (stage 3 swaps
NaN placeholders for views of the gathered buffer), start collectives and touch Python state.
Traced by dynamo, they gave wrong tensor metadata inside the graph (the HF forward then failed
with ``arange() ... got device=torch.Size``). So each is wrapped in ``torch._dynamo.disable``: dynamo
breaks the graph around the hook, runs it eagerly, and compiles the module's forward on its own
(with the parameters whole), as FSDP2's hooks are kept out of the graph. The cost is the graph
breaks the hooks cause; ``docs/architecture.md`` ("torch.compile") counts them per layer.

Stage 3's check for released parameters (a ``TorchFunctionMode``, ``zero/stage3/external.py``) must not be
entered from such a hook while dynamo is tracing the model around it: in torch 2.13 the resumed
frames then read tensor attributes wrongly (the HF forward failed with ``arange() ... got
device=torch.Size``). :func:`forward_is_compiled` tells the hook to skip it there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

F = TypeVar("F", bound=Callable)


def eager_hook(fn: F) -> F:
    """``fn`` run outside any compiled graph (a graph break where dynamo meets it)."""
    return torch._dynamo.disable(fn, reason="shardwise sharding hook: gathers / releases parameters")


def forward_is_compiled(module: nn.Module) -> bool:
    """True when ``module``'s call runs under ``torch.compile``: ``torch.compile(module)`` (an
    ``OptimizedModule`` is calling it) or ``module.compile()``. Read from inside an eager hook."""
    in_optimized = getattr(torch._dynamo.eval_frame, "_is_in_optimized_module", None)
    return bool(in_optimized is not None and in_optimized()) or \
        getattr(module, "_compiled_call_impl", None) is not None
