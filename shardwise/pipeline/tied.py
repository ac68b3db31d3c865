"""Tied layers across stages (``TiedLayerSpec``): one weight, a copy on each rank that uses it.

The rank holding the key's first use (the lowest virtual stage: with interleaving that need not be
the lowest rank) owns the weight; the other ranks hold copies. At the start the owner's values are
sent to every copy (their shapes checked on both sides: a mismatch is one line on each rank). After
the step the owner sends the updated weight to the copies.

The gradient. In one process the weight's gradient for a micro-batch is the sum of its uses'
gradients in the order autograd meets them (the last use first), and the micro-batches' gradients
are then accumulated in order. Each copy sets its gradient aside (its own is kept at zero, so its
optimizer leaves it be) and, by default (``exact``), sends each micro-batch's to the owner after its
backward of that micro-batch; the owner adds them to its own in its backward of the same micro-batch
(the first use's backward comes last, so the copies' have been sent by then), in the one-process
order: the uses by virtual stage, last first. The owner then accumulates, reduces and steps on the
one-process gradient, bit for bit where each rank and chunk holds at most one use of the key (a rank
holding several sums them in its own order first). That costs one transfer of the tied weight per
micro-batch and copy. ``exact=False`` sends each copy's sum over the batch once, after its last
micro-batch (DeepSpeed's traffic: it all-reduces the gradient over the tied stages once a batch and
steps every copy); the sum is then in another order (within ``tests/tolerance.py``'s floor).

Interleaved 1F1B (virtual stages): a rank may hold uses in several chunks. Its chunks' gradients
for a micro-batch are kept aside in the same way until its last backward of that micro-batch that
uses the key, and a tie whose uses sit on several chunks of one rank only is summed there in the
one-process order too.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from shardwise.engine.compat import UsageError
from shardwise.pipeline.module import PipelineModule
from shardwise.pipeline.wire import Link
from shardwise.zero import GatheredParameters


@dataclass
class Tie:
    """One key's uses as this rank sees them: ``ranks`` (owner first), the highest virtual stage of
    each rank's uses (the position of its contribution in the sum), and this rank's own chunks."""

    key: str
    index: int  # among every key of the model (labels the transfers)
    ranks: list[int]
    top: dict[int, int]
    weights: list[torch.Tensor]
    chunks: list[int]

    @property
    def owner(self) -> int:
        return self.ranks[0]


def _ties(module: PipelineModule, stage: int) -> list[Tie]:
    """The ties this rank takes part in that autograd cannot sum alone (uses on other ranks or chunks)."""
    p, out = module.num_stages, []
    for index, key in enumerate(module.tied_keys()):
        virtual = sorted({bisect.bisect_right(module.parts, i) - 1 for i in module.tied_layers(key)})
        ranks = list(dict.fromkeys(v % p for v in virtual))  # the first use's rank first: the owner
        mine = [v // p for v in virtual if v % p == stage]
        if mine and len(virtual) > 1:
            top = {r: max(v for v in virtual if v % p == r) for r in ranks}
            out.append(Tie(key, index, ranks, top, module.tied_weights(key), mine))
    return out


class TiedWeights:
    """This rank's part in every tie that spans ranks or chunks."""

    def __init__(self, module: PipelineModule, link: Link, stage: int):
        self.link, self.stage, self.p = link, stage, module.num_stages
        self.local = _ties(module, stage)
        self.keys = len(module.tied_keys())
        # (key, stages, weights) of the ties across ranks, owner first (the engine's checkpoint reads it)
        self.ties = [(t.key, t.ranks, t.weights) for t in self.local if len(t.ranks) > 1]
        self.exact, self.micro_batches = True, 1
        self.labelled = False  # the engine's transfers carry labels (set by the engine)
        self.current = (0, 0)  # (micro-batch, chunk) of the backward running
        # by (tensor, micro-batch: 0 when summed over the batch): (virtual stage, gradient) set aside or received
        self._aside: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = {}
        self._incoming: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = {}
        self._received: set[tuple[int, int]] = set()

    def synchronize(self) -> None:
        """Give every copy the owner's values; refuse ties whose shapes differ (on every rank involved)."""
        for key, stages, weights in self.ties:
            if self.stage == stages[0]:
                for s in stages[1:]:
                    self.link.send(tuple(w.detach() for w in weights), s)
                shapes = [self.link.recv(s, f"tied {key!r} shapes", self.link.device) for s in stages[1:]]
                self.link.drain()
                for s, got in zip(stages[1:], shapes, strict=True):
                    if int(got[0][0]) == 0:
                        raise UsageError(self._mismatch(key, stages[0], s, weights, got[1:]))
                continue
            values = self.link.recv(stages[0], f"tied {key!r} weights", weights[0].device)
            ok = len(values) == len(weights) and all(v.shape == w.shape for v, w in zip(values, weights, strict=False))
            dev = self.link.device
            self.link.send((torch.tensor([int(ok)], device=dev), *(torch.tensor(list(w.shape), device=dev)
                                                                  for w in weights)), stages[0])
            self.link.drain()
            if not ok:
                raise UsageError(self._mismatch(key, stages[0], self.stage, values, [torch.tensor(list(w.shape))
                                                                                    for w in weights]))
            with torch.no_grad():
                for w, v in zip(weights, values, strict=True):
                    w.copy_(v)

    @staticmethod
    def _mismatch(key: str, owner: int, other: int, owner_w: list, other_shapes: list) -> str:
        a = [tuple(w.shape) for w in owner_w]
        b = [tuple(int(d) for d in s) for s in other_shapes]
        return (f"TiedLayerSpec {key!r}: the tied weights have shapes {a} on stage {owner} but {b} on stage "
                f"{other}; every use of a key must build the same shapes")

    def hook(self) -> None:
        """Register the gradient hooks (each tied tensor of every tie held here)."""
        for tie in self.local:
            for w in tie.weights:
                if w.requires_grad:
                    w.register_hook(self._hook(tie, w))

    def _sends(self, tie: Tie, i: int) -> bool:
        """Micro-batch ``i``'s backward exchanges this tie's gradients (each, or the batch's last)."""
        return self.exact or i == self.micro_batches - 1

    def _slot(self, w: torch.Tensor, i: int) -> tuple[int, int]:
        """Where micro-batch ``i``'s gradient of ``w`` waits: its own slot, or the batch's one."""
        return id(w), i if self.exact else 0

    def _hook(self, tie: Tie, w: torch.Tensor):
        def hook(g: torch.Tensor) -> torch.Tensor:
            i, c = self.current
            owner = self.stage == tie.owner
            if owner and c == tie.chunks[0]:  # the first use's backward: the micro-batch's sum is taken here
                return self._take(tie, w, g, i) if self._sends(tie, i) else g
            if owner and not self.exact:
                return g
            aside = self._aside.setdefault(self._slot(w, i), [])
            if owner or not aside:  # in backward order: a chunk's contribution after the later chunks'
                aside.append((c * self.p + self.stage, g.detach().clone()))
            else:  # a copy sums its own uses (the later chunks' first), over the batch when not exact
                aside[0] = (aside[0][0], aside[0][1] + g)
            return torch.zeros_like(g)
        return hook

    def _take(self, tie: Tie, w: torch.Tensor, g: torch.Tensor, i: int) -> torch.Tensor:
        """The owner's gradient for micro-batch ``i`` (or the batch): every use's, last use first."""
        if len(tie.ranks) > 1 and (tie.index, i) not in self._received:
            self._receive(tie, i)
        slot = self._slot(w, i)
        parts = sorted(self._aside.pop(slot, []) + self._incoming.pop(slot, []), key=lambda vt: -vt[0])
        if not parts:
            return g
        total = parts[0][1]
        for _, t in parts[1:]:
            total = total + t
        return total + g

    def _label(self, tie: Tie, i: int) -> int | None:
        """Labelled transfers (interleaved, zb_h1): this exchange's label, apart from the engine's."""
        return -(2 + i * self.keys + tie.index) if self.labelled else None

    def _receive(self, tie: Tie, i: int) -> None:
        """The copies' gradients of micro-batch ``i`` (every tensor of the tie, from each copy)."""
        self._received.add((tie.index, i))
        for r in tie.ranks[1:]:
            got = self.link.recv(r, f"the tied {tie.key!r} gradients of micro-batch {i}", tie.weights[0].device,
                                 self._label(tie, i))
            for w, t in zip(tie.weights, got, strict=True):
                self._incoming.setdefault(self._slot(w, i), []).append((tie.top[r], t))

    def after_backward(self, i: int, c: int) -> None:
        """After backward (``i``, ``c``): a copy sends what it set aside when that was its last use of the
        micro-batch (every micro-batch's, or with ``exact=False`` the batch's last)."""
        for tie in self.local:
            if self.stage != tie.owner and c == tie.chunks[0] and self._sends(tie, i):
                sums = tuple(self._aside.pop(self._slot(w, i), [(0, torch.zeros_like(w))])[0][1] for w in tie.weights)
                self.link.send(sums, tie.owner, self._label(tie, i))

    def begin(self, micro_batches: int) -> None:
        """A batch starts: nothing of an earlier one (that raised midway) is kept."""
        self.micro_batches = micro_batches
        self._received.clear()
        self._aside.clear()
        self._incoming.clear()

    def finish(self) -> None:
        """After the batch's backwards: every gradient set aside or received was taken (else one line)."""
        if self._aside or self._incoming:
            held = {w for w, _ in [*self._aside, *self._incoming]}
            left = {t.key for t in self.local for w in t.weights if id(w) in held}
            self._aside.clear()
            self._incoming.clear()
            self.link.stop()  # the copies wait for the weights: they end now, naming this stage
            raise UsageError(f"TiedLayerSpec {sorted(left)}: a tied tensor got gradients from a later use but none "
                             f"from its first use on stage {self.stage}; the first use must use every tied_weight_attr")

    def publish(self) -> None:
        """After the step: the owner's updated weights to every copy (at ZeRO-3 gathered over the
        stage's data-parallel ranks for the exchange; each copy's ranks write the same values)."""
        for key, stages, weights in self.ties:
            if self.stage == stages[0]:
                with GatheredParameters(weights):
                    for s in stages[1:]:
                        self.link.send(tuple(w.detach().clone() for w in weights), s)
                continue
            values = self.link.recv(stages[0], f"tied {key!r} weights", weights[0].device)
            with GatheredParameters(weights, modifier_rank=0), torch.no_grad():
                for w, v in zip(weights, values, strict=True):
                    w.copy_(v)
