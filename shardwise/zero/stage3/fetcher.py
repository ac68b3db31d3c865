"""Stage 3 scheduling: gather a unit's parameters just before it runs, release after.

A *unit* is a module whose parameters are gathered together: for HF models the
classes in ``model._no_split_modules`` (e.g. ``LlamaDecoderLayer``); otherwise the
children that hold parameters, looking through containers (``ModuleList``,
``Sequential``, ``ModuleDict``) and through custom modules that hold one, so every
layer of a stack is its own unit. A z3 leaf module (``set_z3_leaf_modules``) is one
unit whatever it holds. The root owns what is left, and parameters shared by two
units.

Forward: a pre-hook gathers the unit and its external parameters (waiting for its
prefetch, if one is in flight) and starts the all-gathers of the next units in the
recorded order, as far as ``stage3_prefetch_bucket_size`` elements allow; a
post-hook releases them. Backward: a hook on the unit's outputs fires when their
gradient arrives, i.e. just before the unit's backward, and gathers it again
(prefetching the units before it); a group releases itself once its gradients are
reduce-scattered.

External parameters (used by a unit that does not own them) are found by
``shardwise.zero.stage3.external``: a read of ``module.weight`` while a unit runs gathers
it and records it as that unit's external, so later forwards gather it with the unit.

The order is recorded during the first forward and re-recorded whenever a
forward takes another path, silently (one debug line).

A submodule called on its own (not from the model's forward) gathers what it reads through
``shardwise.zero.stage3.direct_calls``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from shardwise.zero.eager_hooks import eager_hook, forward_is_compiled
from shardwise.zero.flat_group import ShardedGroup
from shardwise.zero.stage3.direct_calls import DirectCalls
from shardwise.zero.stage3.external import ReleasedUseCheck, track_access
from shardwise.zero.stage3.leaf import z3_leaf_module

log = logging.getLogger("shardwise")

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _holds_stack(m: nn.Module) -> bool:
    """True for a container of layers, or a module with one inside (split it into its layers)."""
    return any(isinstance(d, _CONTAINERS) and _has_params(d) for d in m.modules())


def find_units(model: nn.Module) -> list[nn.Module]:
    """Modules whose parameters are gathered together, outermost root last."""
    names = set(getattr(model, "_no_split_modules", None) or [])

    def walk(m: nn.Module, by_class: bool, out: list[nn.Module]) -> list[nn.Module]:
        for c in m.children():
            if not _has_params(c):
                continue
            if z3_leaf_module(c) or type(c).__name__ in names:
                out.append(c)
            elif by_class or isinstance(c, _CONTAINERS) or _holds_stack(c):
                walk(c, by_class, out)
            else:
                out.append(c)
        return out

    units = walk(model, True, []) if names else []
    if not units:  # no _no_split_modules (or none of its classes is present): split by structure
        units = walk(model, False, [])
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
        self.trace: list[int] = []
        self.all_gathered = False  # generate(): the whole model stays gathered
        self.held = False  # hold(): gathered across backwards too (a pipeline batch), see hold()
        self.peak_gathered_bytes = 0  # most bytes of full (unsharded) parameters alive at once
        self.root = len(units) - 1
        self.stack: list[int] = []  # units whose forward is running, innermost last
        self.external: list[dict[int, ShardedGroup]] = [{} for _ in units]  # unit -> groups it borrows
        self.unit_of_module = {id(u): ui for ui, u in enumerate(units)}
        self.unit_of_group = {id(g): ui for ui, gs in enumerate(groups) for g in gs}
        names = {id(m): n for n, m in units[-1].named_modules()}
        self.unit_names = [names.get(id(u)) or type(u).__name__ for u in units]
        self.check_next = True  # run the next forward under ReleasedUseCheck (first forwards, new paths)
        self._check: ReleasedUseCheck | None = None
        self._handles = []
        self.on_backward: Callable[[], None] | None = None  # the builder's backward-completion hook
        for gs in groups:
            for g in gs:
                g.fetcher = self
        for ui, unit in enumerate(units):
            self._handles.append(unit.register_forward_pre_hook(eager_hook(self._make_pre_forward(ui))))
            self._handles.append(unit.register_forward_hook(eager_hook(self._make_post_forward(ui)),
                                                            always_call=ui == self.root))
        track_access(units[-1])
        self.direct = DirectCalls(self)  # a submodule called on its own gathers what it reads

    def begin_trace(self) -> None:
        """A forward starts from the top (the root's, or a direct call's): record its units anew."""
        self.trace = []

    def running_name(self) -> str:
        """The module whose own code runs now: a direct call's module, else the innermost unit."""
        name = self.direct.running_name()
        if name is not None:
            return name
        return self.unit_names[self.stack[-1]] if self.stack else "the model"

    # -- forward ----------------------------------------------------------------------
    def _make_pre_forward(self, ui: int):
        def hook(module, args):
            if self.all_gathered:
                return
            if ui == self.root:
                self.trace, self.stack = [], []
                if self.check_next and self._check is None and not forward_is_compiled(module):
                    self._check = ReleasedUseCheck(self)
                    self._check.__enter__()
            self.trace.append(ui)
            self.stack.append(ui)
            self._gather(ui)
            pos = len(self.trace) - 1
            if self.order[:pos + 1] == self.trace:
                self._prefetch(self.order[pos + 1:])
        return hook

    def _make_post_forward(self, ui: int):
        def hook(module, args, output):
            if ui == self.root and self._check is not None:  # also runs when forward raised
                self._check.__exit__(None, None, None)
                self._check = None
            if self.all_gathered:
                return output
            if ui in self.stack:
                del self.stack[len(self.stack) - 1 - self.stack[::-1].index(ui)]
            if ui == self.root:
                self.check_next = self.trace != self.order
                if self.order and self.check_next:
                    log.debug("stage 3: the model took another path; re-recorded the unit order")
                self.order = list(self.trace)
                self.stack = []
            self._release(ui)
            if torch.is_grad_enabled() and output is not None:
                tensors = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
                if tensors:
                    register_multi_grad_hook(tensors, self._make_pre_backward(ui), mode="any")
            return output
        return hook

    # -- external parameters ------------------------------------------------------------
    def on_access(self, group: ShardedGroup, module: nn.Module | None = None) -> None:
        """A released group is needed now: by the running unit (a ``module.weight`` read), or by
        ``module`` (``register_external_parameter``). Gather it and remember it as that unit's
        external, so its next forward and its backward gather it with its own groups."""
        if self.all_gathered:
            return
        ui = self.unit_of_module.get(id(module)) if module is not None else None
        if ui is None:
            if not self.stack:
                return  # not inside the model's forward: a placeholder (shape reads work)
            ui = self.stack[-1]
        if self.unit_of_group.get(id(group)) != ui and id(group) not in self.external[ui]:
            self.external[ui][id(group)] = group
            log.debug(f"stage 3: {self.unit_names[ui]!r} uses parameters of another unit; "
                      "gathering them with it from now on")
        group.gather()
        self.measure()

    def forget_external(self, group: ShardedGroup) -> None:
        for ext in self.external:
            ext.pop(id(group), None)

    # -- backward ---------------------------------------------------------------------
    def _make_pre_backward(self, ui: int):
        def hook(_grad):
            if self.on_backward is not None:
                self.on_backward()
            self._gather(ui)
            if ui in self.order:
                pos = self.order.index(ui)
                # the root's backward starts first and its units' follow (last first): read them ahead now
                self._prefetch(self.order[pos + 1:][::-1] if ui == self.root else self.order[:pos][::-1])
        return hook

    # -- helpers ----------------------------------------------------------------------
    def groups_of(self, ui: int) -> list[ShardedGroup]:
        """The unit's own groups, then those it borrows."""
        return self.groups[ui] + list(self.external[ui].values()) if self.external[ui] else self.groups[ui]

    def _gather(self, ui: int) -> None:
        for g in self.groups_of(ui):
            g.gather()
        self.measure()

    def _release(self, ui: int) -> None:
        """Release the unit's groups and what it borrowed, except groups of units still running.

        After a training forward the groups keep their hpZ secondary shard for the backward.
        """
        running = set(self.stack)
        keep = torch.is_grad_enabled()
        for g in self.groups_of(ui):
            if self.unit_of_group.get(id(g)) not in running:
                g.release(keep_secondary=keep)

    def measure(self) -> None:
        live = sum(g.padded_numel * g.flat_param.element_size()
                   for gs in self.groups for g in gs if g.is_gathered and g.policy.shard_params)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, live)

    def _prefetch(self, upcoming: list[int]) -> None:
        """Gather ahead: the next units while they fit in ``prefetch_numel`` (counting those
        already in flight, so the window does not slide ahead) and in ``max_live_numel``."""
        live = sum(g.padded_numel for gs in self.groups for g in gs if g.is_gathered and g.policy.shard_params)
        window = 0
        for uj in upcoming:
            gs = self.groups_of(uj)
            size = sum(g.padded_numel for g in gs if g.policy.shard_params)
            new = sum(g.padded_numel for g in gs if g.policy.shard_params and not g.is_gathered)
            window += size
            if window > self.prefetch_numel or live + new > self.max_live_numel:
                break
            for g in gs:
                g.gather(async_op=True)
            if any(not g.is_gathered for g in gs if g.policy.shard_params):
                break  # the gather pool is full: the rest waits until a unit is released
            live += new
        self.measure()

    def make_room(self, group: ShardedGroup) -> bool:
        """A gather needs a pool buffer now and none is free: release a unit that was only read
        ahead (gathered, not running, not ``group``'s own), waiting for its read first. True when
        one was released; its prefetch is simply redone when its turn comes."""
        running = set(self.stack)
        mine = self.unit_of_group.get(id(group))
        for uj in reversed(self.order or range(len(self.units))):
            if uj in running or uj == mine:
                continue
            held = [g for g in self.groups[uj] if g.pool is not None and g.is_gathered]
            if held:
                for g in held:
                    g.release()
                return True
        return False

    def gather_all(self) -> None:
        for gs in self.groups:
            for g in gs:
                g.gather()
        self.all_gathered = True

    def release_all(self) -> None:
        self.all_gathered = False
        self.held = False
        for gs in self.groups:
            for g in gs:
                g.release()

    def hold(self) -> None:
        """Gather every group and keep it gathered through every forward and backward until
        :meth:`release_all` (a pipeline batch at stage 3: one all-gather per group per batch instead
        of two per micro-batch; the end of a backward does not release a held model)."""
        self.gather_all()
        self.held = True
        self.measure()  # peak_gathered_bytes: the whole (padded) stage, held through the batch

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self.direct.remove()
