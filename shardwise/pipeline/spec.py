"""``LayerSpec`` / ``TiedLayerSpec`` (a layer described, built only on the stage that owns it) and the
partition methods that decide which stage owns which layer.

The partitions are DeepSpeed's: ``uniform`` (equal layer counts, the first stages one more when they
do not divide), ``parameters`` (balance the trainable parameter counts) and ``type:REGEX`` (balance
the layers whose class name matches). Balancing is the linear-partition problem: cut the sequence of
weights into ``n`` contiguous parts so that the spread between the heaviest and the lightest part is
smallest; among equal spreads the latest cut wins. A script that prints ``module.parts`` or relies on
which stage holds which layer sees DeepSpeed's answer.
"""

from __future__ import annotations

import math
import re
from typing import Any

from torch import nn

from shardwise.engine.compat import UsageError


class LayerSpec:
    """A layer's class and arguments, built later (``build()``) by the stage that owns it only."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any):
        if not issubclass(typename, nn.Module):
            raise UsageError(f"LayerSpec({typename!r}): the type must be a torch.nn.Module subclass")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"

    def build(self, log: bool = False) -> nn.Module:  # noqa: ARG002 - DeepSpeed's signature
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose module (or the attributes named by ``tied_weight_attr``) is shared by every use of
    ``key``: one module per stage holding a use, their weights kept equal and trained as one.
    ``forward_fn(module, x)``, when given, is what a use computes instead of ``module(x)``."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Any = None,
                 tied_weight_attr: str | list[str] = "weight", **module_kwargs: Any):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` runs of equal length (the first ``num_items % num_parts`` one longer)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    return [p * size + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: list[float], num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` contiguous runs of ``weights`` whose (max - min) run sum is smallest
    (ties: the latest cut), by dynamic programming over (items, parts)."""
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = math.inf
    # best[i][j]: (spread, max, min) of the best cut of the first i items into j parts; cut[i][j]: its last start
    best = [[(inf, inf, inf)] * (num_parts + 1) for _ in range(n + 1)]
    cut = [[0] * (num_parts + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, 0.0, inf)
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            for k in range(i):
                run = prefix[i] - prefix[k]
                hi, lo = max(best[k][j - 1][1], run), min(best[k][j - 1][2], run)
                if best[i][j][0] >= hi - lo:
                    best[i][j], cut[i][j] = (hi - lo, hi, lo), k
    bounds = [n]
    for j in range(num_parts, 0, -1):
        bounds.append(cut[bounds[-1]][j])
    return bounds[::-1]


def _spec_name(layer: Any) -> str | None:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def _param_count(layer: Any) -> int:
    """Trainable parameters of one layer; a spec is built to count them (one at a time, then dropped),
    as DeepSpeed does: the random numbers this draws are part of what the stages' layers start from."""
    module = layer.build() if isinstance(layer, LayerSpec) else layer
    if not isinstance(module, nn.Module):
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def partition_layers(specs: list[Any], num_stages: int, method: str) -> list[int]:
    """Stage boundaries (``num_stages + 1`` indices into ``specs``) by DeepSpeed's ``partition_method``."""
    method = str(method).lower()
    if method == "uniform":
        return partition_uniform(len(specs), num_stages)
    if method == "parameters":
        return partition_balanced([_param_count(s) for s in specs], num_stages)
    if method.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        marks = [1 if (name := _spec_name(s)) is not None and pattern.search(name) else 0 for s in specs]
        if not any(marks):
            raise UsageError(f"partition_method {method!r}: no layer's class name matches; the layers are "
                             f"{[_spec_name(s) for s in specs]}")
        return partition_balanced(marks, num_stages)
    raise UsageError(f"partition_method {method!r} is not served: use 'parameters', 'uniform' or 'type:REGEX'")
