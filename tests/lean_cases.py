"""Rank-side checks of stage 3's lean backward (used by test_stage3_lean.py).

A stage-3 bucket starts filling beside at most ``limit - 1`` pending reductions
(``InflightLimit.make_room``), and on gloo a reduce-scatter into a separate shard receives the other
rank's chunk into that shard, with no receive buffer (``comm/gloo_exchange.py``). Byte counts here are
exact, from the model's sizes: a group's bucket is its padded numel in the gradient dtype.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from tiny_models import batches
from transformers import AutoModelForCausalLM, LlamaConfig
from zero_cases import make_config, run_micro_batches

import shardwise
import shardwise.comm.gloo_exchange as gloo_exchange
from shardwise.zero import GatheredParameters
from shardwise.zero.pending import InflightLimit


def build_llama(layers: int = 4, seed: int = 0) -> torch.nn.Module:
    """A tiny Llama with enough decoder layers for two reductions to be pending behind a filling bucket."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    cfg.attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg)
    model.train()
    return model


def _live_buckets(groups: list) -> tuple[list[int], int]:
    """Indices of the groups whose gradient bucket is live (filling, or reducing and not yet waited for),
    and the bytes of those buckets."""
    live, nbytes = [], 0
    for i, g in enumerate(groups):
        held = ([g._bucket_base] if g._bucket_base is not None else []) + list(g._buckets_in_flight)
        if held:
            live.append(i)
            nbytes += sum(b.numel() * b.element_size() for b in held)
    return live, nbytes


def await_exchanges(groups, limit_s: float = 60.0) -> None:
    """Block until the communication of every pending reduction of ``groups`` is over (their additions
    and the bucket's hand-over still left to ``wait()``): the state in which the next bucket's take
    finds them when the exchange was fast, made certain."""
    deadline = time.monotonic() + limit_s
    while not all(g.reductions_completed() for g in groups):
        assert time.monotonic() < deadline, "a reduce-scatter's exchange did not end"
        time.sleep(0.0005)


class LateExchanges:
    """Within ``with``: every exchange ends after the take of the next bucket, before its next gradient (the
    other rank was behind): ``finish_completed`` at a take finds nothing over, at a gradient hook
    (``keep=False``) it first waits for the pending exchanges. ``finished``: reductions the hooks finished;
    ``after``: called after each hook's finish."""

    def __init__(self, after=None):
        self.finished, self.after = 0, after

    def __enter__(self) -> LateExchanges:
        self.original = finish = InflightLimit.finish_completed

        def late(limit: InflightLimit, keep: bool = True) -> None:
            if keep:
                return
            await_exchanges(list(limit._queue))
            before = len(limit._queue)
            finish(limit, keep)
            self.finished += before - len(limit._queue)
            if self.after is not None:
                self.after(limit)

        InflightLimit.finish_completed = late
        return self

    def __exit__(self, *exc) -> None:
        InflightLimit.finish_completed = self.original


def bucket_sequence(overlap: bool, gas: int, force: str = "") -> dict:
    """Two bf16 steps at stage 3 (every parameter sharded), recording at each bucket's first gradient which
    groups hold a live bucket, and every receive buffer gloo's reduce-scatter takes (elements).

    ``force="take"``: before each take, wait until the exchanges of the pending reductions are over (not
    their ``wait()``), so the take finds the previous group's reduction finished but not waited for.
    ``force="hook"``: the exchanges end only after the take (``LateExchanges``); ``hooks`` records, after
    each gradient hook's finish, the filling group, the live buckets and the bytes kept for reuse."""
    with LateExchanges() if force == "hook" else _nothing() as late:
        return _bucket_sequence(overlap, gas, force, late)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def _bucket_sequence(overlap: bool, gas: int, force: str, late: LateExchanges | None) -> dict:
    rank = dist.get_rank()
    model = build_llama()
    cfg = make_config(3, precision="bf16", overlap=overlap, gas=gas, stage3_param_persistence_threshold=0)
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    groups = engine.groups
    takes: list[tuple[int, list[int], int]] = []
    buffers: list[int] = []
    for i, g in enumerate(groups):
        def taken(take=g._take_bucket, i=i) -> None:
            if force == "take":
                await_exchanges(groups)
            take()
            takes.append((i, *_live_buckets(groups)))
        g._take_bucket = taken
    hooks: list[tuple[int, list[int], int]] = []
    if late is not None:
        late.after = lambda limit: hooks.append((takes[-1][0], _live_buckets(groups)[0], limit.free_nbytes))
    comm = groups[0].comm
    take_buffer = comm._take_buffer

    def buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffers.append(numel)
        return take_buffer(numel, dtype, device)

    comm._take_buffer = buffer
    data = batches(2, gas, 2 * 2, 16, vocab=64)
    run_micro_batches(engine, data, rank, 2)
    del comm._take_buffer
    return {"padded": [g.padded_numel for g in groups], "takes": takes, "buffers": buffers,
            "shard": [g.shard_numel for g in groups], "hooks": hooks,
            "finished_at_hooks": late.finished if late is not None else 0}


def train(lean: bool, overlap: bool, gas: int, precision: str, **zero_extra) -> dict:
    """Three stage-3 steps; ``lean=False`` runs as before the change (no early wait, a receive buffer for
    every chunk): the bit-for-bit baseline."""
    make_room, apart = InflightLimit.make_room, gloo_exchange._apart
    if not lean:
        InflightLimit.make_room = lambda self: None
        gloo_exchange._apart = lambda a, b: False
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        model = build_llama()
        cfg = make_config(3, precision=precision, overlap=overlap, gas=gas, dp=world,
                          stage3_param_persistence_threshold=0, **zero_extra)
        engine, *_ = shardwise.initialize(model=model, config=cfg)
        losses = run_micro_batches(engine, batches(3, gas, 2 * world, 16, vocab=64), rank, 2)
        with GatheredParameters(model.parameters()):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        InflightLimit.make_room, gloo_exchange._apart = make_room, apart  # a pool worker runs other cases next
    return {"losses": losses, "weights": weights}


def train_early(early: str, overlap: bool, gas: int, precision: str, **zero_extra) -> dict:
    """Three stage-3 steps. ``early="take"``: every bucket's take finds the pending reductions' exchanges
    over (``await_exchanges``) and finishes them; ``"hook"``: they end after the take and a gradient hook
    finishes them (``LateExchanges``); ``""``: they stay pending as before the early finish
    (``InflightLimit.finish_completed`` a no-op): the bit-for-bit baseline. ``finished_early``: how
    many reductions were finished early."""
    if early == "hook":
        with LateExchanges() as late:
            out = train(True, overlap, gas, precision, **zero_extra)
        return {**out, "finished_early": late.finished}
    finish, make_room = InflightLimit.finish_completed, InflightLimit.make_room
    finished = [0]

    def counted(self, keep: bool = True) -> None:
        before = len(self._queue)
        finish(self, keep)
        finished[0] += before - len(self._queue)

    def after_exchanges(self) -> None:
        await_exchanges(list(self._queue))
        make_room(self)

    InflightLimit.finish_completed = counted if early else (lambda self, keep=True: None)
    InflightLimit.make_room = after_exchanges
    try:
        out = train(True, overlap, gas, precision, **zero_extra)
    finally:
        InflightLimit.finish_completed, InflightLimit.make_room = finish, make_room
    return {**out, "finished_early": finished[0]}


def master_store_bytes(offload: str) -> dict:
    """A bf16 stage-3 engine with fp32 masters (every parameter sharded): which tensor is each group's
    persistent copy, and the bytes it and ``memory_report()`` count, before and after a step."""
    from shardwise.zero.store import MasterStore

    rank = dist.get_rank()
    model = build_llama(layers=2)
    extra = {}
    if offload == "param":
        extra["offload_param"] = {"device": "cpu"}
    if offload in ("param", "optimizer"):
        extra["offload_optimizer"] = {"device": "cpu"}
    cfg = make_config(3, precision="bf16", stage3_param_persistence_threshold=0, **extra)
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    groups = engine.groups

    def held() -> dict:
        return {"master_store": [isinstance(g.store, MasterStore) and g.param_shard is g.master for g in groups],
                "store_bytes": [g.store.nbytes for g in groups],
                "shard_dtype": [str(g.param_shard.dtype) for g in groups],
                "report": {k: int(v) for k, v in engine.memory_report().items()}}

    out = {"shard": [g.own_numel for g in groups], "built": held()}
    run_micro_batches(engine, batches(1, 1, 4, 16, vocab=64), rank, 2)
    out["stepped"] = held()
    return out


def master_store_edits() -> dict:
    """Writes that must land in the fp32 master when it is the persistent copy: a ``GatheredParameters``
    edit on one rank, and ``safe_set_full_fp32_param`` with a value bf16 cannot hold."""
    from shardwise.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    rank = dist.get_rank()
    model = build_llama(layers=2)
    cfg = make_config(3, precision="bf16", stage3_param_persistence_threshold=0)
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    run_micro_batches(engine, batches(1, 1, 4, 16, vocab=64), rank, 2)
    w = model.model.layers[0].mlp.up_proj.weight
    edit = torch.linspace(-1, 1, w.numel()).reshape(w.shape).to(torch.bfloat16)
    with GatheredParameters([w], modifier_rank=0):
        if rank == 0:
            w.data.copy_(edit)
    after_edit = safe_get_full_fp32_param(w)
    fine = torch.linspace(-1, 1, w.numel()).reshape(w.shape) + 1e-4  # not bf16 numbers
    safe_set_full_fp32_param(w, fine)
    master = safe_get_full_fp32_param(w)
    with GatheredParameters([w]):
        gathered = w.detach().clone()
    return {"edit": edit.float(), "after_edit": after_edit, "fine": fine, "master": master, "gathered": gathered}


def train_store(master_store: bool, overlap: bool, gas: int, precision: str) -> dict:
    """Three stage-3 steps; ``master_store=False`` keeps a 16-bit shard beside the fp32 master, as before."""
    from shardwise.zero.flat_group import ShardedGroup

    chooses = ShardedGroup._master_is_the_store
    if not master_store:
        ShardedGroup._master_is_the_store = lambda self, offload: False
    try:
        return train(True, overlap, gas, precision)
    finally:
        ShardedGroup._master_is_the_store = chooses


def work_completion() -> dict:
    """``Work.is_completed`` on gloo's point-to-point reduce-scatter: False until watched (gloo's sends and
    receives complete only in a wait), True once watched and the other rank has sent, without running
    the additions (the shard still holds what was received); ``wait()`` then adds as it always did."""
    from shardwise.comm import make_comm

    rank = dist.get_rank()
    comm = make_comm("world")
    full = torch.arange(8, dtype=torch.float32) + 10 * rank
    out = torch.empty(4)
    work = comm.reduce_scatter(full, out, async_op=True)
    dist.barrier()  # both ranks have posted their sends and receives
    unwatched = work.is_completed()
    work.watch()
    deadline = time.monotonic() + 60
    while not work.is_completed():
        assert time.monotonic() < deadline, "the exchange did not end"
        time.sleep(0.0005)
    received = out.clone()  # the other rank's chunk, not yet summed
    work.wait()
    composite = comm.all_reduce_in_rank_order(full.clone(), async_op=True)  # a work made of works
    composite_says = composite.is_completed()
    composite.wait()
    return {"unwatched": unwatched, "received": received, "out": out, "composite": composite_says}
