"""The zero-bubble schedule's two halves of a backward on a stage (``pipeline.schedule: "zb_h1"``).

``("B", i)`` runs micro-batch ``i``'s backward to the stage's inputs only and sends their gradient
upstream at once; ``("W", i)``, later, runs it to the stage's weights (``pipeline/split.py``). For the
engine W is the micro-batch's backward: ZeRO's groups are armed for it (the boundary's reduction in the
batch's last W), the tied-weight hooks fire in it, and the engine's ``step()`` follows it (the optimizer
steps after the last). B arms the groups without a reduction and no parameter receives a gradient in it.
The schedule runs the W passes in micro-batch order, so the sums are 1F1B's (``docs/pipeline.md``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from shardwise.engine import Engine
from shardwise.engine.checks import track_used
from shardwise.engine.compat import UsageError
from shardwise.pipeline.split import SplitBackward


@contextlib.contextmanager
def _splittable() -> Iterator[None]:
    """Autograd's refusal of a reentrant checkpoint in a split pass, as one line saying what to change."""
    try:
        yield
    except RuntimeError as e:
        if "use_reentrant=True" not in str(e):
            raise
        raise UsageError("pipeline.schedule zb_h1 with reentrant activation checkpointing inside the layers "
                         "(torch.utils.checkpoint(use_reentrant=True), e.g. a model's own gradient checkpointing) "
                         "is not served: its backward cannot be split; use use_reentrant=False or the 1f1b "
                         "schedule") from None


class ZeroBubbleSteps:
    """``PipelineEngine``'s B and W steps (mixed in; the state is the engine's)."""

    def _split_roots(self: Any, i: int, state: dict) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """What B differentiates: the last stage's scaled loss (as ``Engine.backward``: loss x 1/gas), or
        this stage's outputs with the gradients the next stage sent back."""
        if self._last(0):
            loss = state["loss_of"].pop(i)
            state["loss_now"] = loss  # for the monitor, as Engine.backward records it
            return [loss * (1.0 / self.gas)], [None]
        outs = state["outputs"].pop((i, 0))
        grads = self.link.recv(self.stage_id + 1, f"the gradients of micro-batch {i}", self.device,
                               self._label(i, 0, 1, 0))
        floats = [o for o in outs if o.is_floating_point()]  # one gradient came back for each
        pairs = [(o, g) for o, g in zip(floats, grads, strict=True) if o.requires_grad]
        if not pairs:
            raise UsageError(f"pipeline stage {self.stage_id}: no output of micro-batch {i} requires grad, so "
                             "no gradient can flow back through this stage")
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _backward_input(self: Any, i: int, state: dict) -> None:
        """B: the inputs' gradients, sent upstream now; the weights' part kept for W."""
        roots, grads = self._split_roots(i, state)
        inputs = [t for t in state["inputs"].pop((i, 0), ()) if t.is_floating_point()]
        split = SplitBackward(roots, grads, inputs, [p for p in self.module.parameters() if p.requires_grad])
        self.sharding.arm_passes(False)  # no parameter gets a gradient here: nothing to reduce
        wanted = [t for t in inputs if t.requires_grad]
        loss = state.pop("loss_now", None)  # the monitor's timers and loss record, as in one backward
        timer = self.monitor.backward(loss) if loss is not None else self.monitor.phase("bwd", "backward")
        with timer, self.monitor.backward_inner(), _splittable():
            got = split.input_pass()
        self.sharding.finish_backward()
        if not self._first(0):
            sent = dict(zip(map(id, wanted), got, strict=True))
            self.link.send(tuple(sent.get(id(t)) if sent.get(id(t)) is not None else torch.zeros_like(t)
                                 for t in inputs), self.stage_id - 1, self._label(i, 0, 1, -1),
                           f"the gradients of micro-batch {i}")
        state["splits"][i] = split

    def _backward_weight(self: Any, i: int, state: dict) -> None:
        """W: the weights' gradients of micro-batch ``i``, accumulated as one backward would; then the
        engine's per-micro-batch ``step()`` (the optimizer's at the boundary, after the batch's last W)."""
        self.tied.current = (i, 0)  # the tied-weight hooks fire in W: they file micro-batch i's gradients
        reduce_now = self.is_gradient_accumulation_boundary() and not self._in_no_sync
        track_used(self)
        self.sharding.arm_passes(reduce_now)
        with self.monitor.phase("bwd", "backward"), self.monitor.backward_inner(), _splittable():
            state["splits"].pop(i).weight_pass()
        with self.monitor.phase("bwd_allreduce"):
            self.sharding.finish_backward()
        self._grads_reduced = reduce_now
        self.tied.after_backward(i, 0)
        Engine.step(self)
