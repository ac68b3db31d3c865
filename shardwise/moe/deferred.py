"""Expert parallelism on a model built under ``shardwise.zero.Init`` (``deepspeed.zero.Init``).

zero.Init leaves every parameter on the meta device until ``initialize`` materializes the model
one stage-3 unit at a time (``shardwise/sharded_init/context.py``). Expert parallelism runs before that and
needs each rank's experts real, so for each MoE layer only its two 3-D expert parameters are
materialized here, and only this rank's ``E / ep`` experts are kept:

- from the checkpoint folder of a zero.Init ``from_pretrained``: rows ``first .. first + local`` of
  the stored ``[E, ...]`` tensor are one contiguous element range, so each rank reads exactly its
  experts (nothing else of the tensor is read, nothing is gathered);
- otherwise (``from_config``): the model's own init runs on the experts module, rank 0's values are
  broadcast (as ``GatheredParameters`` before ``initialize`` does) and each rank keeps its slice;
  one layer's full experts exist at a time.

Every other parameter stays on meta, and the engine's zero.Init path materializes it as before;
the expert parameters are real by then, so it shards them as they are (over the
expert-data-parallel group, like a model built whole).
"""

from __future__ import annotations

from torch import nn

from shardwise.comm import Comm
from shardwise.sharded_init.context import SafetensorsSource, materialize_for_gather, swap_contents, tied_aliases


def _root_of(p: nn.Parameter) -> nn.Module | None:
    ref = getattr(p, "_shardwise_root", None) or getattr(p, "_shardwise_owner", None)
    return ref() if ref is not None else None


def materialize_local_experts(params: list[nn.Parameter], first: int, local: int, world: Comm) -> bool:
    """Give one experts module's meta expert ``params`` ([E, ...]) real values, experts
    ``first .. first + local - 1`` only; False (nothing done) when none is on meta. Collective
    over ``world`` when the values come from the model's init."""
    if not any(p.is_meta for p in params):
        return False
    root = _root_of(params[0])
    source = getattr(root, "_shardwise_source", None) if root is not None else None
    if source is None:
        materialize_for_gather(params, world)  # full tensors, rank 0's init on every rank
        for p in params:
            p.data = p.data.narrow(0, first, local).clone()
        return True
    files, aliases = SafetensorsSource(source, root), tied_aliases(root)
    for p in params:
        per = p.numel() // p.shape[0]  # elements of one expert
        names = aliases[id(p)]
        rows = files.read(names[0], p.shape, first * per, (first + local) * per, names[1:])
        real = nn.Parameter(rows.to(p.dtype).view(local, *p.shape[1:]).clone(), requires_grad=p.requires_grad)
        swap_contents(p, real)
    return True
