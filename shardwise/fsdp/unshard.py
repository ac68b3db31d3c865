"""Give a sharded model back its whole, plain parameters, so a new engine can wrap it.

DeepSpeed lets a script call ``initialize`` again on a model an earlier engine wraps (a notebook
cell run twice; DeepSpeed's checkpoint tests load into "a fresh engine" on the same model). The
earlier engine's groups own the parameters' storage and hooks, so before sharding again every
group is gathered, each parameter gets its own copy of its full value, and every hook the earlier
sharding installed is removed. The earlier engine must not be used afterwards: its optimizer
steps masters that no parameter reads any more.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from shardwise.fsdp.module import forget_sharding, sharding_of

log = logging.getLogger("shardwise")


def unshard_module(model: nn.Module) -> None:
    """Collective on the earlier sharding's ranks: whole parameters back, hooks off, slot cleared."""
    sharding = sharding_of(model)
    if sharding.tp is not None and sharding.tp.size > 1:
        raise NotImplementedError(f"{type(model).__name__} was split by tensor parallelism in an earlier engine; "
                                  "it cannot be wrapped again: build the model anew for the new engine")
    sharding.remove()
    seen: set[int] = set()
    with torch.no_grad():
        for g in sharding.groups + [g for gs in sharding.unit_groups for g in gs]:
            if id(g) in seen:
                continue
            seen.add(id(g))
            g.gather(exact=True)
            g.wait_gathered()
            for p in g.params:
                p.data = p.data.clone()  # its own storage, no longer a view of the group's buffer
                p.grad = None
                p.__dict__.pop("_shardwise_group", None)
    forget_sharding(model)
    log.info(f"{type(model).__name__} was wrapped by an earlier engine: its parameters were gathered back "
             "whole and it is sharded again; do not use the earlier engine any more")
