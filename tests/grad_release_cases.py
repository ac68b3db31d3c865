"""Rank-side checks of stage 3's gradient release (used by test_stage3_grad_release.py).

At stage 3 a group's reduced 16-bit gradient shard lives from the group's first reduce-scatter of a
step to the step: it is let go once upcast into the fp32 master's gradient (one group at a time) and
at ``zero_grad``, as FSDP2 frees its gradients. The byte counts here are exact, from the model's
sizes: a group's shard is ``ceil(numel / N)`` elements.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tiny_models import batches, build
from zero_cases import make_config, run_micro_batches

import shardwise
from shardwise.zero import GatheredParameters
from shardwise.zero.flat_group import ShardedGroup


def _held(groups: list, dtype: torch.dtype) -> int:
    """Bytes of the gradient shards of ``dtype`` the groups hold (16-bit shards, or the masters' grads)."""
    total = 0
    for g in groups:
        for t in {id(t): t for t in (g.shard_grad, g.master.grad) if t is not None}.values():
            if t.dtype == dtype:
                total += t.numel() * t.element_size()
    return total


def _record(groups: list, after_upcast: list, before_reduce: list) -> None:
    """Wrap each group's upcast and reduce-scatter to record the gradient bytes held around them."""
    for i, g in enumerate(groups):
        attach, reduce = g.attach_master_grad, g.reduce_grads

        def attached(scale: float, attach=attach, i=i) -> torch.Tensor:
            out = attach(scale)
            after_upcast.append((i, _held(groups, torch.bfloat16), _held(groups, torch.float32)))
            return out

        def reducing(reduce=reduce, i=i) -> None:
            before_reduce.append((i, _held(groups, torch.bfloat16)))
            reduce()

        g.attach_master_grad, g.reduce_grads = attached, reducing


def release_sequence(overlap: bool, gas: int) -> dict:
    """Two bf16 steps with fp32 masters at stage 3 (every parameter sharded), recording the gradient bytes
    held after each group's upcast in a step, before each group's reduce-scatter in a backward, after the
    last backward of a step and after the step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("llama")
    cfg = make_config(3, precision="bf16", overlap=overlap, gas=gas, stage3_param_persistence_threshold=0)
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    groups = engine.groups
    sizes = {id(p): p.numel() for p in model.parameters()}
    numels = [-(-sum(sizes[id(p)] for p in g.params) // world) for g in groups]
    data, out = batches(2, gas, 2 * world, 16), []
    for s in range(2):
        after_upcast: list = []
        before_reduce: list = []
        _record(groups, after_upcast, before_reduce)
        for m in range(gas):
            ids = data[s, m, rank * 2:(rank + 1) * 2]
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            if m == gas - 1:
                after_backward = _held(groups, torch.bfloat16)
            engine.step()
        for g in groups:  # unwrap for the next step's records
            del g.attach_master_grad, g.reduce_grads
        out.append({"after_upcast": after_upcast, "before_reduce": before_reduce, "after_backward": after_backward,
                    "after_step": _held(groups, torch.bfloat16) + _held(groups, torch.float32),
                    "report_grads": int(engine.memory_report()["grads"])})
    from shardwise.utils import safe_get_full_grad

    read = safe_get_full_grad(model.model.layers[0].mlp.up_proj.weight)  # after the step: zeros, as before
    return {"numels": numels, "steps": out, "read_after_step_zero": read is not None and not read.any().item()}


def train(release: bool, overlap: bool, gas: int, precision: str) -> dict:
    """Three stage-3 steps; ``release=False`` keeps the 16-bit shards as before (the bit-for-bit baseline)."""
    kept = ShardedGroup.release_grad_shard
    if not release:
        ShardedGroup.release_grad_shard = lambda self: None
    try:
        rank = dist.get_rank()
        model = build("llama")
        cfg = make_config(3, precision=precision, overlap=overlap, gas=gas, stage3_param_persistence_threshold=0)
        engine, *_ = shardwise.initialize(model=model, config=cfg)
        losses = run_micro_batches(engine, batches(3, gas, 4, 16), rank, 2)
        with GatheredParameters(model.parameters()):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        ShardedGroup.release_grad_shard = kept  # a pool worker runs other cases next
    return {"losses": losses, "weights": weights}
