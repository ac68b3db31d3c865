"""Stage 3 scheduling: gather a unit's parameters just before it runs, release after.

A *unit* is a module whose parameters are gathered together: for HF models the
classes in ``model._no_split_modules`` (e.g. ``LlamaDecoderLayer``), otherwise
each direct child that holds parameters; the root owns what is left.

Forward: a pre-hook gathers the unit (waiting for its prefetch, if one is in
flight) and starts the all-gathers of the next units in the recorded order, as
far as ``stage3_prefetch_bucket_size`` elements allow; a post-hook releases it.
Backward: a hook on the unit's outputs fires when their gradient arrives, i.e.
just before the unit's backward, and gathers it again (prefetching the units
before it); the group releases itself once its gradients are reduce-scattered.

The order is recorded during the first forward and re-recorded whenever a
forward takes another path, silently (one debug line).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from shardwise.zero.flat_group import ShardedGroup

log = logging.getLogger("shardwise")


def find_units(model: nn.Module) -> list[nn.Module]:
    """Modules whose parameters are gathered together, outermost root last."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    units = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not units:
        units = [c for c in model.children() if any(True for _ in c.parameters())]
    return units + [model]


def assign_params(model: nn.Module, units: list[nn.Module]) -> dict[int, list[nn.Parameter]]:
    """Map unit index -> its parameters (innermost unit wins; params shared across units go to root)."""
    owner: dict[int, int] = {}
    by_id: dict[int, nn.Parameter] = {}
    root = len(units) - 1
    for ui, unit in enumerate(units[:-1]):
        for p in unit.parameters():
            if id(p) in owner and owner[id(p)] != ui:
                owner[id(p)] = root  # shared by two units: keep it gathered with the root
            else:
                owner[id(p)] = ui
            by_id[id(p)] = p
    out: dict[int, list[nn.Parameter]] = {i: [] for i in range(len(units))}
    for p in model.parameters():
        out[owner.get(id(p), root)].append(p)
    return out


class ParamFetcher:
    """Installs the gather/release hooks on every unit and keeps the prefetch order."""

    def __init__(self, units: list[nn.Module], groups: list[list[ShardedGroup]], prefetch_numel: int,
                 max_live_numel: int = 1 << 62):
        self.units, self.groups, self.prefetch_numel = units, groups, prefetch_numel
        self.max_live_numel = max_live_numel  # stage3_max_live_parameters: prefetch stops there
        self.order: list[int] = []
        self._trace: list[int] = []
        self.all_gathered = False  # generate(): the whole model stays gathered
        self.peak_gathered_bytes = 0  # most bytes of full (unsharded) parameters alive at once
        self._handles = []
        for ui, unit in enumerate(units):
            self._handles.append(unit.register_forward_pre_hook(self._make_pre_forward(ui)))
            self._handles.append(unit.register_forward_hook(self._make_post_forward(ui)))

    # -- forward ----------------------------------------------------------------------
    def _make_pre_forward(self, ui: int):
        def hook(module, args):
            if self.all_gathered:
                return
            if ui == len(self.units) - 1:
                self._trace = []
            self._trace.append(ui)
            self._gather(ui)
            pos = len(self._trace) - 1
            if self.order[:pos + 1] == self._trace:
                self._prefetch(self.order[pos + 1:])
        return hook

    def _make_post_forward(self, ui: int):
        def hook(module, args, output):
            if self.all_gathered:
                return output
            if ui == len(self.units) - 1 and self._trace != self.order:
                if self.order:
                    log.debug("stage 3: the model took another path; re-recorded the unit order")
                self.order = list(self._trace)
            for g in self.groups[ui]:
                g.release()
            if torch.is_grad_enabled():
                tensors = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
                if tensors:
                    register_multi_grad_hook(tensors, self._make_pre_backward(ui), mode="any")
            return output
        return hook

    # -- backward ---------------------------------------------------------------------
    def _make_pre_backward(self, ui: int):
        def hook(_grad):
            self._gather(ui)
            if ui in self.order:
                pos = self.order.index(ui)
                self._prefetch(self.order[:pos][::-1])
        return hook

    # -- helpers ----------------------------------------------------------------------
    def _gather(self, ui: int) -> None:
        for g in self.groups[ui]:
            g.gather()
        self._measure()

    def _measure(self) -> None:
        live = sum(g.padded_numel * g.flat_param.element_size()
                   for gs in self.groups for g in gs if g.is_gathered and g.policy.shard_params)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, live)

    def _prefetch(self, upcoming: list[int]) -> None:
        """Gather ahead: the next units while they fit in ``prefetch_numel`` (counting those
        already in flight, so the window does not slide ahead) and in ``max_live_numel``."""
        live = sum(g.padded_numel for gs in self.groups for g in gs if g.is_gathered and g.policy.shard_params)
        window = 0
        for uj in upcoming:
            size = sum(g.padded_numel for g in self.groups[uj] if g.policy.shard_params)
            new = sum(g.padded_numel for g in self.groups[uj] if g.policy.shard_params and not g.is_gathered)
            window += size
            if window > self.prefetch_numel or live + new > self.max_live_numel:
                break
            live += new
            for g in self.groups[uj]:
                g.gather(async_op=True)
        self._measure()

    def gather_all(self) -> None:
        for gs in self.groups:
            for g in gs:
                g.gather()
        self.all_gathered = True

    def release_all(self) -> None:
        self.all_gathered = False
        for gs in self.groups:
            for g in gs:
                g.release()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
