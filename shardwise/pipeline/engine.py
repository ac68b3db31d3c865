"""``PipelineEngine``: DeepSpeed's pipeline engine (``train_batch`` / ``eval_batch``) on shardwise's engine.

Each rank's engine is an ordinary shardwise :class:`~shardwise.engine.Engine` around its stage's
layers, whose ZeRO group is the stage's data-parallel group: the optimizer, the precision modes,
ZeRO-1's sharded optimizer state, checkpoints and ``comm_stats()`` are the engine's. What this class
adds is the schedule (``pipeline/schedule.py``): a batch is ``gradient_accumulation_steps``
micro-batches; the first stage reads each one's inputs and the last its labels from the data
iterator; activations go forward and their gradients back through the pipeline's
:class:`~shardwise.comm.PointToPoint` (``pipeline/wire.py``). The last stage's loss is scaled by
1/micro-batches as the engine scales any accumulated loss; another stage's backward is that of
``sum(output * received_gradient)``, whose gradient with respect to the output is the received one
bit for bit, so each stage's gradients are those of the same layers in one process. The step is the
engine's, once per batch, with the gradient norm (for clipping) taken over every stage.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from shardwise.comm import compute_device, make_point_to_point
from shardwise.engine import Engine
from shardwise.engine.compat import UsageError
from shardwise.pipeline.generate import generate as pipeline_generate
from shardwise.pipeline.module import PipelineModule
from shardwise.pipeline.schedule import eval_steps, train_steps
from shardwise.pipeline.tied import TiedWeights
from shardwise.pipeline.wire import Link, StageTransferError, as_tensors
from shardwise.pipeline.zero_bubble import ZeroBubbleSteps


class PipelineEngine(ZeroBubbleSteps, Engine):
    """One stage's engine (DeepSpeed's ``PipelineEngine``): ``train_batch()``, ``eval_batch()``."""

    def __init__(self, module: PipelineModule, config: Any, schedule: str = "1f1b", **engine_kwargs: Any):
        grid = module.mpu()
        link = Link(make_point_to_point(grid.get_pipe_parallel_group(), None), grid.get_stage_id(), grid.pp_group,
                    compute_device())
        tied = TiedWeights(module, link, grid.get_stage_id())
        tied.synchronize()  # before the engine flattens the parameters
        super().__init__(module, config, model_is_tp=True, **engine_kwargs)
        self.grid, self.link, self.tied, self.schedule = grid, link, tied, schedule
        self.link.p2p.stats = self.layout.stats  # the transfers count into comm_stats()
        self.num_stages, self.stage_id = grid.pipe_parallel_size, grid.get_stage_id()
        self.micro_batches, self.micro_batch_size = self.gas, config.train_micro_batch_size_per_gpu
        self.prev_stage, self.next_stage = self.stage_id - 1, self.stage_id + 1
        self.virtual = module.virtual_stages  # chunks of layers on this rank (interleaved_1f1b)
        self.link.ring = self.virtual > 1
        # labelled transfers (a stash for those that arrive early) where a pair of ranks does not send in the
        # order the other receives: the ring of virtual stages, and zb_h1 (a copy's tied sums of micro-batch
        # i leave after its B of i + 1, while the owner takes them in its W of i)
        self.labelled = self.tied.labelled = self.virtual > 1 or schedule == "zb_h1"
        self.data_iterator: Iterator | None = None
        self.training_dataloader = None
        self.holds_one_stage = self.num_stages > 1  # its checkpoint loads take this stage's tensors only
        self.batch_fn = None
        self.agg_train_loss: torch.Tensor | None = None
        self.monitor.defer_boundary = True  # its progress line and monitors report train_batch's loss
        self.tied.hook()
        self.reduce_once = False
        self.set_reduce_once(self.policy.shard_grads)  # ZeRO-2/3: one reduce-scatter per batch (docs/pipeline.md)
        if self.num_stages > 1:
            inner = self.sharding.grad_norm
            self.sharding.grad_norm = lambda grads: self._pipeline_norm(inner(grads))

    def set_reduce_once(self, on: bool) -> None:
        """ZeRO-2/3: accumulate each micro-batch's gradients in the stage's full local buckets and
        reduce-scatter them once, after the batch's last micro-batch, with the stage-3 parameters held
        gathered from the first forward to the last backward (``on``, the default); or reduce-scatter
        after every micro-batch into the shard, gathering per unit, as the engine's accumulation does."""
        if self.schedule == "zb_h1" and self.policy.shard_grads and not on:
            raise UsageError("set_reduce_once(False) with pipeline.schedule zb_h1 is not served: its split backward "
                             "reduces once per batch")
        self.reduce_once = bool(on) and self.policy.shard_grads
        for g in self.sharding.groups:
            g.defer_reduce = self.reduce_once

    def set_tied_exact(self, on: bool) -> None:
        """Tied weights across stages: send each micro-batch's gradient of a copy to the owner, summed in
        one process's order (``on``, the default: bit for bit one process), or each copy's sum once a
        batch (DeepSpeed's traffic, the sum in another order); ``pipeline/tied.py``."""
        self.tied.exact = bool(on)

    def _pipeline_norm(self, norm: float) -> float:
        """The gradient norm over every stage (each stage's squares summed over the pipeline)."""
        sq = torch.tensor([norm * norm], dtype=torch.float64, device=self.link.device)
        self.link.p2p.all_reduce(sq)
        return math.sqrt(float(sq))

    # -- DeepSpeed's pipeline accessors ------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def set_dataiterator(self, iterator: Iterator) -> None:
        if self.is_first_stage() or self.is_last_stage():
            self.data_iterator = iterator

    def set_dataloader(self, loader: Any) -> None:
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader, self.data_iterator = loader, iter(loader)

    def set_batch_fn(self, fn: Any) -> None:
        self.batch_fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise UsageError("Only train_batch() is accessible in pipeline mode (and eval_batch() for evaluation)")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise UsageError("Only train_batch() is accessible in pipeline mode: it runs forward, backward and step")

    def step(self, *args: Any, **kwargs: Any) -> Any:
        raise UsageError("Only train_batch() is accessible in pipeline mode: it runs forward, backward and step")

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """HF ``generate()`` of a Hugging Face model split by ``pipeline.stages``, decoded through the
        stages (``pipeline/generate.py``); collective over the pipeline, the same tokens on every stage."""
        if args:
            raise UsageError("generate() on a pipeline takes keyword arguments (input_ids=..., max_new_tokens=...)")
        return pipeline_generate(self, **kwargs)

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """The engine's checkpoint, written by every stage into one folder (each tensor under its layer's
        name, so it loads at any number of stages, data-parallel degree or ZeRO stage). A weight tied
        across stages is written by its owner (the first stage using it) only: the copies hold its values,
        and on load each copy reads the owner's tensor and optimizer state under the one name."""
        copies = {id(w) for _, stages, weights in self.tied.ties if self.stage_id != stages[0] for w in weights}
        self.copies_not_saved = frozenset(n for g in self.groups for n, p in zip(g.names, g.params, strict=True)
                                          if id(p) in copies)
        return Engine.save_checkpoint(self, *args, **kwargs)

    # -- a batch -------------------------------------------------------------------------
    def _next_batch(self) -> Any:
        batch = next(self.data_iterator) if self.data_iterator is not None else None
        return self.batch_fn(batch) if self.batch_fn else batch

    def _first(self, c: int) -> bool:
        """Chunk ``c`` of this rank is the first virtual stage (reads the inputs)."""
        return self.stage_id == 0 and c == 0

    def _last(self, c: int) -> bool:
        """Chunk ``c`` of this rank is the last virtual stage (reads the labels, computes the loss)."""
        return self.stage_id == self.num_stages - 1 and c == self.virtual - 1

    def _label(self, i: int, c: int, kind: int, step: int) -> int | None:
        """Labelled transfers: the transfer's label (micro-batch, receiving virtual stage, kind), else None."""
        if not self.labelled:
            return None
        return (i * self.num_stages * self.virtual + c * self.num_stages + self.stage_id + step) * 2 + kind

    def _stage_input(self, i: int, c: int, state: dict) -> Any:
        """Chunk ``c``'s input for micro-batch ``i``: read (first stage) or received; labels kept (last)."""
        first, last = self._first(c), self._last(c)
        batch = self._next_batch() if first or last else None
        if batch is None and (first or last):
            raise UsageError(f"pipeline stage {self.stage_id}: no data; pass train_batch(data_iter=...) or "
                             "initialize(training_data=...)")
        if last:
            state["labels"][i] = self._to_device(batch[1])
        if first:
            return self._to_device(batch[0], copy=True)
        got = self.link.recv((self.stage_id - 1) % self.num_stages, f"the activations of micro-batch {i}",
                             self.device, self._label(i, c, 0, 0))
        for t in got:
            t.requires_grad_(t.is_floating_point() and torch.is_grad_enabled())
        state["inputs"][(i, c)] = got
        return got[0] if len(got) == 1 else got

    def _to_device(self, value: Any, copy: bool = False) -> Any:
        """A batch's tensor (or tuple/list of tensors) on the compute device, detached (copied: ``copy``)."""
        if torch.is_tensor(value):
            return value.detach().to(self.device, copy=copy)
        if isinstance(value, (tuple, list)):
            return tuple(self._to_device(v, copy) for v in value)
        return value

    def _forward(self, i: int, state: dict, c: int = 0) -> None:
        x = self._stage_input(i, c, state)
        out = self.module(x) if self.virtual == 1 else self.module(x, chunk=c, micro_offset=state["offset"] + i + 1)
        if not self._last(c):
            tensors = as_tensors(out, self.stage_id, "output")
            self.link.send(tensors, (self.stage_id + 1) % self.num_stages, self._label(i, c, 0, 1),
                           f"the activations of micro-batch {i}")
            state["outputs"][(i, c)] = tensors
            return
        labels = state["labels"].pop(i)
        loss = self.module.loss_fn(out, labels) if state["loss"] and self.module.loss_fn is not None else out
        if state.get("logits"):
            state["last_output"] = out
        state["losses"].append(loss.detach() if torch.is_tensor(loss) else [v.detach() for v in loss])
        state["loss_of"][i] = loss

    def _backward(self, i: int, state: dict, c: int = 0) -> None:
        last = (i, c) == state["last_backward"]
        self.tied.current = (i, c)
        if self.virtual > 1:  # m x v backwards a batch: the boundary (reduce, step) is the last one's
            self._forced_boundary = last
        if self._last(c):
            Engine.backward(self, state["loss_of"].pop(i))
        else:
            outs = state["outputs"].pop((i, c))
            grads = self.link.recv((self.stage_id + 1) % self.num_stages, f"the gradients of micro-batch {i}",
                                   self.device, self._label(i, c, 1, 0))
            floats = [o for o in outs if o.is_floating_point()]  # one gradient came back for each
            pairs = [(o, g) for o, g in zip(floats, grads, strict=True) if o.requires_grad]
            if not pairs:
                raise UsageError(f"pipeline stage {self.stage_id}: no output of micro-batch {i} requires grad, so "
                                 "no gradient can flow back through this stage")
            Engine.backward(self, sum((o * g).sum() for o, g in pairs), scale_wrt_gas=False)
        if not self._first(c):
            inputs = state["inputs"].pop((i, c))
            sent = tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if t.is_floating_point())
            self.link.send(sent, (self.stage_id - 1) % self.num_stages, self._label(i, c, 1, -1),
                           f"the gradients of micro-batch {i}")
        self.tied.after_backward(i, c)
        if c == 0:  # one step() per micro-batch (its chunk-0 backward comes last), as the engine counts them
            Engine.step(self)

    def _run(self, steps: list[tuple], state: dict) -> None:
        backwards = [tuple(st[1:]) + (0,) * (3 - len(st)) for st in steps if st[0] == "B"]
        state["last_backward"] = backwards[-1] if backwards else None
        split = self.schedule == "zb_h1"  # B to the inputs, W to the weights (pipeline/zero_bubble.py)
        if split and self.module.training and self.module.activation_checkpoint_interval > 0:
            raise UsageError("activation checkpointing with pipeline.schedule zb_h1 is not served (its weight pass "
                             "would recompute each checkpointed chunk once per layer); use 1f1b")
        run = {"F": self._forward, "B": self._backward_input if split else self._backward, "W": self._backward_weight}
        try:
            for kind, i, *chunk in steps:
                run[kind](i, state, *chunk)
        except (UsageError, StageTransferError):
            self.link.stop()  # the neighbours waiting on this stage end now, naming it
            raise
        finally:
            self._forced_boundary = None if self.virtual > 1 else getattr(self, "_forced_boundary", None)
        self.link.drain()

    def _take_offsets(self, m: int) -> int:
        """Interleaved: the seed offsets of this batch's ``m`` micro-batches (one each, however many
        chunks it runs through); the module's counter moves past them. Returns the first minus one."""
        base = self.module.micro_offset
        if self.virtual > 1:
            self.module.micro_offset = base + m
        return base

    @staticmethod
    def _state(compute_loss: bool = True, logits: bool = False) -> dict:
        return {"labels": {}, "inputs": {}, "outputs": {}, "loss_of": {}, "losses": [], "loss": compute_loss,
                "logits": logits, "offset": 0, "splits": {}}

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """Train on one batch (``gradient_accumulation_steps`` micro-batches from ``data_iter`` on the
        first and last stages) and step; returns the mean loss over micro-batches and data-parallel
        ranks, on every rank."""
        if not torch.is_grad_enabled():
            raise UsageError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        state = self._state()
        state["offset"] = self._take_offsets(self.micro_batches)
        held = self.fetcher is not None and self.reduce_once  # ZeRO-3: gathered through the batch
        if held:
            self.fetcher.hold()
        try:
            self.tied.begin(self.micro_batches)
            self._run(train_steps(self.schedule, self.micro_batches, self.num_stages, self.stage_id, self.virtual),
                      state)
            self.tied.finish()
        finally:
            if held:
                self.fetcher.release_all()
        self.wait_for_params()
        self.tied.publish()
        self.link.drain()
        self.agg_train_loss = self._mean_loss(state["losses"], self.micro_batches)
        self.monitor.finish_batch(self.agg_train_loss)
        return self.agg_train_loss

    def eval_batch(self, data_iter: Iterator, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """Forward ``num_micro_batches`` (default: the training count) micro-batches without gradients;
        returns their mean loss (over micro-batches and data-parallel ranks), on every rank with
        ``bcast_loss``; with ``return_logits`` also the last micro-batch's output (last stage)."""
        if reduce_output not in ("avg", None):
            raise UsageError(f"eval_batch(reduce_output={reduce_output!r}): use 'avg' or None")
        was_training, saved = self.module.training, self.data_iterator
        self.module.eval()
        self.set_dataiterator(data_iter)
        m = self.micro_batches if num_micro_batches is None else int(num_micro_batches)
        state = self._state(compute_loss, return_logits)
        state["offset"] = self._take_offsets(m)
        with torch.no_grad():
            self._run(eval_steps(m, self.virtual), state)
        self.data_iterator = saved
        self.module.train(was_training)
        if reduce_output is None:
            return (state["losses"], state.get("last_output")) if return_logits else state["losses"]
        loss = self._mean_loss(state["losses"], m, broadcast=bcast_loss)
        return (loss, state.get("last_output")) if return_logits else loss

    def _mean_loss(self, losses: list, m: int, broadcast: bool = True) -> torch.Tensor | None:
        """Last stage: the sum over micro-batches / m, averaged over data-parallel ranks; then sent to
        every stage (DeepSpeed's aggregate)."""
        out = torch.zeros(1, dtype=torch.float32, device=self.device)
        if self.is_last_stage():
            total = torch.zeros_like(losses[0])
            for v in losses:
                total += v
            mean = total / m
            if self.comm.size > 1:
                self.comm.all_reduce(mean)
                mean /= self.comm.size
            out = mean.detach().float().reshape(-1)[:1].clone()
        if broadcast and self.num_stages > 1:
            self.link.p2p.broadcast(out, src=self.num_stages - 1)
        return out[0] if (broadcast or self.is_last_stage()) else None
