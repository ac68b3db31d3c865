"""Stage 3: a submodule called on its own gathers what its forward reads, and releases it after.

The units' hooks (``zero/stage3/fetcher.py``) gather a decoder layer before it runs, and the root's hooks
gather what no unit owns (embeddings, final norm, head, parameters shared by two units). A module
called directly, not from the model's forward (``t5.get_encoder()(ids)`` in ``generate``, a
fused loss calling ``lm_head`` or the embedding, a test calling ``layers[0].mlp``), used to run
none of those hooks above it and computed with NaN placeholders. Here every module holding
sharded parameters gets a pre/post hook pair that makes such a call an *entry*:

* before it runs: the groups holding its parameters (those of units nested inside it excepted:
  their own hooks gather them) are gathered, and the unit it lies in (the root when none) is
  pushed as running, so an attribute read of another parameter during the call gathers it too
  (``zero/stage3/external.py``), with a registered external parameter;
* after it: what the entry gathered is released, and a hook on its outputs gathers it again
  before the entry's backward (a group releases itself once its gradients are reduced, and the
  end of backward releases the rest);
* the first call of each entry, and the next after it visited other units, runs under
  ``ReleasedUseCheck``: a released parameter reached through a reference no hook sees raises an
  error naming the parameter and the module, never a NaN result.

Why the whole-model step costs nothing more: the hooks' first statement returns when a forward
is already gathering (the fetcher's running stack is not empty, or the model is gathered whole),
which is the case for every module call inside the model's forward. What remains is PyTorch's
per-call hook dispatch (about a microsecond per module call on CPU); ``benchmarks/zero/bench_direct_calls.py``
measures the step with and without these hooks, figures in ``docs/architecture.md``. The
nested-path check is plain Python on the fetcher's state, so dynamo traces it inside compiled
layers (no graph break); the work of an entry runs eagerly (``eager_hook``).

Outside any module call (user code reading ``model.lm_head.weight`` at top level) a released
parameter is still the placeholder, as before: shape reads must work there without a
collective. Computing with it needs ``GatheredParameters``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from shardwise.zero.eager_hooks import eager_hook, forward_is_compiled
from shardwise.zero.stage3.external import ReleasedUseCheck

if TYPE_CHECKING:
    from shardwise.zero.flat_group import ShardedGroup
    from shardwise.zero.stage3.parts import FetcherParts


@dataclass
class EntrySpec:
    """What a direct call of one module gathers: its groups, and the unit it counts as running."""

    name: str
    unit: int
    groups: list[ShardedGroup]
    module: weakref.ref  # a deep copy of the model carries these hooks too: they skip its modules


@dataclass
class Entry:
    """One direct call in progress."""

    module: nn.Module
    spec: EntrySpec
    depth: int  # len(fetcher.stack) after the push
    gathered_before: set[int]
    check: ReleasedUseCheck | None = None
    reentered: int = 0  # nested calls of the same module inside it


def _unit_of_module(units: list[nn.Module]) -> dict[int, int]:
    """Module id -> the one unit containing it (a unit maps to itself); absent: the root's."""
    found: dict[int, set[int]] = {}
    for ui, u in enumerate(units[:-1]):
        for d in u.modules():
            found.setdefault(id(d), set()).add(ui)
    return {mid: next(iter(uis)) for mid, uis in found.items() if len(uis) == 1}


class DirectCalls:
    """The entry hooks of one :class:`ParamFetcher`'s model (installed by it, removed with it)."""

    def __init__(self, fetcher: FetcherParts):
        self.fetcher = fetcher
        self.entries: list[Entry] = []
        self.last_trace: dict[int, list[int]] = {}  # module id -> units its last direct call ran
        self.check_next: dict[int, bool] = {}  # module id -> run its next call under the check
        self.handles: list[Any] = []
        self._begin = eager_hook(self._begin_call)
        self._end = eager_hook(self._end_call)
        self._reenter = eager_hook(self._count_reentry)
        root = fetcher.units[-1]
        in_unit = _unit_of_module(fetcher.units)
        for name, m in root.named_modules():
            if m is root:
                continue
            spec = self._spec(name, m, in_unit)
            if spec is not None:
                self.handles.append(m.register_forward_pre_hook(self._make_pre(spec), prepend=True))
                self.handles.append(m.register_forward_hook(self._make_post(), always_call=True))

    def _spec(self, name: str, m: nn.Module, in_unit: dict[int, int]) -> EntrySpec | None:
        """The sharded groups of ``m``'s parameters but those of units strictly inside it; None
        when ``m`` holds no parameter of this fetcher that is ever released and has no registered
        external parameter (its ``register_external_parameter`` hook then gathers those)."""
        f = self.fetcher
        inner = {f.unit_of_module[id(d)] for d in m.modules() if d is not m and id(d) in f.unit_of_module}
        groups: dict[int, ShardedGroup] = {}
        releasable = False
        for p in m.parameters():
            g = getattr(p, "_shardwise_group", None)
            if g is None or getattr(g, "fetcher", None) is not f or not g.policy.shard_params:
                continue
            releasable = True
            if f.unit_of_group.get(id(g)) not in inner:
                groups.setdefault(id(g), g)
        if not releasable and not m.__dict__.get("_shardwise_external"):
            return None
        return EntrySpec(name, in_unit.get(id(m), f.root), list(groups.values()), weakref.ref(m))

    # -- the hooks: plain checks first (traced by dynamo inside compiled layers), work eager -------
    def _make_pre(self, spec: EntrySpec):
        f = self.fetcher

        def pre(module: nn.Module, _args: Any) -> None:
            if f.stack or f.all_gathered:  # inside a gathering forward: every whole-model call
                if self.entries:
                    self._reenter(module)
                return
            self._begin(module, spec)

        return pre

    def _make_post(self):
        def post(module: nn.Module, _args: Any, output: Any) -> None:
            if self.entries:
                self._end(module, output)

        return post

    # -- an entry ---------------------------------------------------------------------------
    def _count_reentry(self, module: nn.Module) -> None:
        if self.entries[-1].module is module:
            self.entries[-1].reentered += 1

    def _begin_call(self, module: nn.Module, spec: EntrySpec) -> None:
        if spec.module() is not module:
            return
        f = self.fetcher
        before = {id(g) for gs in f.groups for g in gs if g.is_gathered}
        f.stack.append(spec.unit)
        f.begin_trace()
        entry = Entry(module, spec, len(f.stack), before)
        self.entries.append(entry)
        if self._needs_check(module):
            entry.check = ReleasedUseCheck(f)
            entry.check.__enter__()
        for g in spec.groups:
            g.gather()
        f.measure()

    def _needs_check(self, module: nn.Module) -> bool:
        """First call of this entry, or the last one visited other units; never in a backward
        (activation checkpointing's recompute) or under torch.compile."""
        if torch._C._current_graph_task_id() != -1 or forward_is_compiled(module):
            return False
        return self.check_next.get(id(module), True)

    def _end_call(self, module: nn.Module, output: Any) -> None:
        entry = self.entries[-1]
        if entry.module is not module:
            return
        if entry.reentered:
            entry.reentered -= 1
            return
        self.entries.pop()
        f = self.fetcher
        if entry.check is not None:
            entry.check.__exit__(None, None, None)
        if output is not None:  # the call returned (not raised): check again once it takes another path
            trace = list(f.trace)
            self.check_next[id(module)] = self.last_trace.get(id(module)) not in (None, trace)
            self.last_trace[id(module)] = trace
        del f.stack[entry.depth - 1:]
        candidates = {id(g): g for g in entry.spec.groups + f.groups_of(entry.spec.unit)}
        mine = [g for g in candidates.values() if g.is_gathered and id(g) not in entry.gathered_before]
        keep = torch.is_grad_enabled()
        for g in mine:
            g.release(keep_secondary=keep)
        if keep and output is not None and mine:
            tensors = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, self._make_pre_backward(mine), mode="any")

    def _make_pre_backward(self, groups: list[ShardedGroup]):
        def hook(_grads: Any) -> None:
            if self.fetcher.on_backward is not None:
                self.fetcher.on_backward()
            for g in groups:
                g.gather()
            self.fetcher.measure()

        return hook

    def running_name(self) -> str | None:
        """The module whose direct call is running its own code now (no unit inside it is)."""
        if self.entries and len(self.fetcher.stack) == self.entries[-1].depth:
            return self.entries[-1].spec.name
        return None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
