"""Tied layers across stages (``TiedLayerSpec``): one weight, a copy on each stage that uses it.

The first stage holding a key owns the weight; the others hold copies. At the start the owner's
values are sent to every copy (their shapes checked on both sides: a mismatch is one line on each
rank). In training each copy's gradient is accumulated aside (the copy's own gradient is kept at
zero, so its optimizer leaves it be) and sent to the owner after the copy's last backward of the
batch; the owner adds the copies' sums into its gradient during its own last backward, before the
gradients are reduced over data-parallel ranks, so the owner steps on the whole gradient (over
every use, micro-batch and replica) exactly once. After the step the owner sends the updated
weight to the copies. DeepSpeed all-reduces the gradient over the stages and steps every copy;
both give the weight the same update (the sum's order differs in the last bits).
"""

from __future__ import annotations

import torch

from shardwise.engine.compat import UsageError
from shardwise.pipeline.module import PipelineModule
from shardwise.pipeline.wire import Link
from shardwise.zero import GatheredParameters


class TiedWeights:
    """This stage's part in every tie that spans stages."""

    def __init__(self, module: PipelineModule, link: Link, stage: int):
        self.link, self.stage = link, stage
        self.ties: list[tuple[str, list[int], list[torch.Tensor]]] = []
        for key in module.tied_keys():
            stages = module.tied_stages(key)
            if len(stages) > 1 and stage in stages:
                self.ties.append((key, stages, module.tied_weights(key)))
        self.last_backward = False
        self._aside: dict[int, torch.Tensor] = {}
        self._incoming: dict[int, torch.Tensor] = {}

    def synchronize(self) -> None:
        """Give every copy the owner's values; refuse ties whose shapes differ (on every rank involved)."""
        for key, stages, weights in self.ties:
            if self.stage == stages[0]:
                self.link.send(tuple(w.detach() for w in weights), stages[1])
                for s in stages[2:]:
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
        """Register the gradient hooks: copies set theirs aside, the owner takes the copies' sums in."""
        for _key, stages, weights in self.ties:
            for w in weights:
                if not w.requires_grad:
                    continue
                w.register_hook(self._owner_hook(w, stages) if self.stage == stages[0] else self._copy_hook(w))

    def _copy_hook(self, w: torch.Tensor):
        def hook(g: torch.Tensor) -> torch.Tensor:
            aside = self._aside.get(id(w))
            self._aside[id(w)] = g.detach().clone() if aside is None else aside.add_(g)
            return torch.zeros_like(g)
        return hook

    def _owner_hook(self, w: torch.Tensor, stages: list[int]):
        def hook(g: torch.Tensor) -> torch.Tensor:
            if not self.last_backward:
                return g
            if id(w) not in self._incoming:
                self._receive(stages)
            extra = self._incoming.pop(id(w), None)
            return g if extra is None else g + extra
        return hook

    def _receive(self, stages: list[int]) -> None:
        """The copies' sums for the tie whose owner hook fired first (every tensor of it, in order)."""
        for _key, s, weights in self.ties:
            if s is stages:
                for other in stages[1:]:
                    got = self.link.recv(other, "tied gradients", weights[0].device)
                    for w, t in zip(weights, got, strict=True):
                        self._incoming[id(w)] = self._incoming[id(w)] + t if id(w) in self._incoming else t

    def send_aside(self) -> None:
        """After a copy's last backward of the batch: its gradient sums to the owner."""
        for _key, stages, weights in self.ties:
            if self.stage != stages[0]:
                sums = tuple(self._aside.pop(id(w), torch.zeros_like(w)) for w in weights)
                self.link.send(sums, stages[0])

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
