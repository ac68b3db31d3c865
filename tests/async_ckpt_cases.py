"""Rank-side asynchronous checkpoint runs (used by test_async_ckpt.py), in the rank pools.

Each case trains the tiny Llama a couple of steps, then saves the same step twice: synchronously,
then asynchronously with the writer held at its first write until training has taken another
step (the weights, masters and Adam moments overwritten while the writer has not read them).
Both folders must hold the same bytes, file by file.
"""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from ckpt_cases import _train, config

import shardwise
from shardwise.checkpoint import CheckpointError, async_save, shard_writer, wait_for_checkpoint


def _engine(stage: int, kind: str = "llama", **cfg_kw):
    cfg = config(stage, dist.get_world_size(), **{k: v for k, v in cfg_kw.items() if k != "extra"})
    cfg.update(cfg_kw.get("extra", {}))
    from tiny_models import build

    engine, *_ = shardwise.initialize(model=build(kind), config=cfg)
    return engine


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


class Held:
    """Hold every writer of this rank at ``phase`` until :meth:`release` (the test seam)."""

    def __init__(self, phase: str = "writing"):
        self.phase, self.gate, self.reached = phase, threading.Event(), threading.Event()
        self.orig = shard_writer.at_phase

    def __enter__(self) -> Held:
        def hold(phase: str) -> None:
            if phase == self.phase:
                self.reached.set()
                assert self.gate.wait(120), "the test never released the writer"

        shard_writer.at_phase = hold
        return self

    def release(self) -> None:
        self.gate.set()

    def __exit__(self, *exc) -> None:
        self.gate.set()
        shard_writer.at_phase = self.orig


def same_bytes(root: str, stage: int, **cfg_kw) -> dict:
    """Sync and async saves of one step, training one step while the async writer is held."""
    engine = _engine(stage, **cfg_kw)
    return _same_bytes_with(engine, lambda a, b: _train(engine, a, b), Path(root))


def same_bytes_kept_buffer(root: str) -> dict:
    """``shardwise.keep_checkpoint_buffer``: two rounds of :func:`same_bytes` on one engine, the second
    async save staged into the buffer the first one kept (the same memory)."""
    from shardwise.checkpoint import staging

    engine = _engine(2, extra={"shardwise": {"keep_checkpoint_buffer": True}})
    first = _same_bytes_with(engine, lambda a, b: _train(engine, a, b), Path(root) / "first")
    kept = staging._KEPT[0].data_ptr()
    second = _same_bytes_with(engine, lambda a, b: _train(engine, a, b), Path(root) / "second")
    return {**second, "first_differ": first.get("differ"), "reused": staging._KEPT[0].data_ptr() == kept}


def same_bytes_nvme(root: str, stage: int, params: bool = False) -> dict:
    """:func:`same_bytes` with ``offload_optimizer.device: nvme`` (masters and Adam moments in swap files,
    streamed from them a group at a time by the save: ``engine/nvme.py``'s ``nvme_streamed``); ``params``
    (stage 3): the parameter shards in swap files too (``offload_param.device: nvme``, every shard on disk)."""
    import tempfile

    swap = tempfile.mkdtemp(dir=root)  # each rank its own folder (SwapFolder adds rank{r} below it anyway)
    cfg = config(stage, dist.get_world_size())
    zero = cfg["zero_optimization"]
    zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap, "buffer_count": 2, "pipeline_read": True,
                                 "pipeline_write": True}
    if params:  # every parameter shard on disk (no persistent ones, none kept in host memory)
        zero.update(stage3_param_persistence_threshold=0, offload_param={
            "device": "nvme", "nvme_path": swap, "buffer_count": 2, "buffer_size": 3000, "max_in_cpu": 0})
    from tiny_models import build

    engine, *_ = shardwise.initialize(model=build("llama"), config=cfg)
    assert engine.nvme is not None and (engine.nvme_params is not None) == params
    try:
        return _same_bytes_with(engine, lambda a, b: _train(engine, a, b), Path(root))
    finally:
        engine.destroy()


def same_bytes_sp(root: str) -> dict:
    """:func:`same_bytes` for Ulysses sequence parallelism 2 (stage 2): each rank trains on its half
    of every sequence (tests/sp_cases.py's model and batches)."""
    from sp_cases import llama, sp_config, step_batches

    from shardwise.sequence_parallel import sequence_parallel_loss, split_batch

    engine, *_ = shardwise.initialize(model=llama(), config=sp_config(2, 2, dist.get_world_size()))
    data = step_batches(engine.dp_world)

    def train(a: int, b: int) -> None:
        for replicas in data[a:b]:
            shard = split_batch(replicas[engine.dp_rank], engine.sequence_parallel)
            labels = shard.pop("shift_labels")
            engine.backward(sequence_parallel_loss(engine(**shard).logits, labels, engine.sequence_parallel))
            engine.step()

    return _same_bytes_with(engine, train, Path(root))


def same_bytes_ep(root: str, stage: int) -> dict:
    """:func:`same_bytes` for a Mixtral with expert parallelism 2 (tests/moe_cases.py)."""
    from moe_cases import batches, build, ds_config

    from shardwise.moe import apply_expert_parallel

    model = build("mixtral")
    apply_expert_parallel(model, 2, preset="mixtral")
    engine, *_ = shardwise.initialize(model=model, config=ds_config(stage, 0.01, 2, dist.get_world_size(), None))
    data = batches(4, dist.get_world_size(), 2)

    def train(a: int, b: int) -> None:
        for s in range(a, b):
            ids = data[s, engine.dp_rank]
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()

    return _same_bytes_with(engine, train, Path(root))


def _same_bytes_with(engine, train, root_p: Path) -> dict:
    train(0, 2)
    engine.save_checkpoint(root_p / "sync", tag="t", asynchronous=False)
    with Held() as held:
        path = engine.save_checkpoint(root_p / "async", tag="t", asynchronous=True)
        pending = async_save.pending_tag()
        while not held.reached.wait(0.01) and async_save.pending_state() == "writing":
            pass  # a rank with nothing to write (stage 0's rank 1) finishes without getting there
        reached = held.reached.is_set()
        published_early = (root_p / "async" / "t").exists()
        train(2, 3)  # overwrites what the writer has not read yet
        held.release()
        wait_for_checkpoint()
    out = {"pending": pending, "published_early": published_early, "path": path, "held": reached,
           "after": async_save.pending_tag(), "latest": (root_p / "async" / "latest").read_text()}
    if dist.get_rank() == 0:
        a, s = _files(root_p / "async" / "t"), _files(root_p / "sync" / "t")
        out["names"] = sorted(s)
        out["differ"] = sorted(n for n in set(a) | set(s) if a.get(n) != s.get(n))
        out["leftovers"] = sorted(p.name for p in (root_p / "async").glob(".*"))
    return out


def switched_on(extra: dict) -> dict:
    """Whether a save under ``extra`` (config keys) is asynchronous; published at a later step."""
    root = Path(extra.pop("_root"))
    engine = _engine(2, extra=extra)
    _train(engine, 0, 1)
    engine.save_checkpoint(root, tag="s")
    pending = async_save.pending_tag()
    steps = 0
    while async_save.pending_tag() is not None and steps < 50:  # published by a step once written
        _train(engine, 1, 2)
        steps += 1
    return {"pending": pending, "published": (root / "latest").is_file(), "steps": steps}


def write_error(root: str, phase: str = "fsync") -> dict:
    """Rank 1's writer fails (ENOSPC) at ``phase``: every rank raises the same error at its next
    step; ``latest`` still names the previous checkpoint; the next save works."""
    root_p = Path(root)
    engine = _engine(2, extra={"shardwise": {"async_checkpoint": True}})
    _train(engine, 0, 1)
    engine.save_checkpoint(root_p, tag="good")
    wait_for_checkpoint()
    orig = shard_writer.at_phase

    def full(p: str) -> None:
        if p == phase and dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    shard_writer.at_phase = full
    err, steps = None, 0
    try:
        engine.save_checkpoint(root_p, tag="bad")
        while err is None and steps < 50:
            try:
                _train(engine, 1, 2)
            except CheckpointError as e:
                err = str(e)
            steps += 1
    finally:
        shard_writer.at_phase = orig
    latest = (root_p / "latest").read_text()
    engine.save_checkpoint(root_p, tag="next")
    wait_for_checkpoint()
    return {"error": err, "latest_after_error": latest, "bad": (root_p / "bad").exists(),
            "latest": (root_p / "latest").read_text(), "pending": async_save.pending_tag(),
            "leftovers": sorted(p.name for p in root_p.glob(".*"))}


STUCK_TIMEOUT_S = 4.0


def stuck_writer(root: str) -> dict:
    """Rank 0's writer never finishes: the wait gives up within the (shortened) collective timeout,
    so the peer, already waiting in the collective, is still there, and every rank raises the
    writer's error; nothing hangs. ``waited``: seconds in ``wait_for_checkpoint``."""
    import datetime

    root_p = Path(root)
    engine = _engine(2, extra={"shardwise": {"async_checkpoint": True}})
    _train(engine, 0, 1)
    orig_timeout = async_save.collective_timeout
    async_save.collective_timeout = lambda: datetime.timedelta(seconds=STUCK_TIMEOUT_S)
    held = Held("fsync") if dist.get_rank() == 0 else None
    try:
        if held is not None:
            held.__enter__()
        engine.save_checkpoint(root_p, tag="slow")
        t0 = time.monotonic()
        try:
            wait_for_checkpoint()
            err = None
        except CheckpointError as e:
            err = str(e)
        waited = time.monotonic() - t0
    finally:
        async_save.collective_timeout = orig_timeout
        if held is not None:
            held.__exit__()
    return {"error": err, "latest": (root_p / "latest").exists(), "pending": async_save.pending_tag(),
            "waited": waited}


def killed_at_phase(argv: list[str]) -> int:
    """(A rank forked by ``fresh_ranks.start``.) ``shardwise train ARGV`` whose rank ``CRASH_RANK``
    SIGKILLs itself when the second save (global_step2) reaches ``CRASH_PHASE``: the first save is
    complete on disk by then (the second waits for it)."""
    import os
    import signal
    import sys

    from shardwise.cli.train import main

    phase, victim, rank = os.environ["CRASH_PHASE"], os.environ["CRASH_RANK"], os.environ["RANK"]
    seen = {"n": 0}

    def hook(p: str) -> None:
        if p == phase and rank == victim:
            seen["n"] += 1
            if seen["n"] == 2:
                print(f"crash: rank {rank} SIGKILLed in {p}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    shard_writer.at_phase = hook
    return main(argv)


def exit_pending(argv: list[str]) -> int:
    """(A process forked by ``fresh_ranks.start``, world 1.) An asynchronous save left pending when
    the script returns: the exit completes it; ``fail`` in ARGV: its writer fails (a full disk), and
    the exit reports it with exit code 1 though the script returned 0."""
    root = Path(argv[0])
    shardwise.init_distributed()
    engine = _engine(2, extra={"shardwise": {"async_checkpoint": True}})
    _train(engine, 0, 1)
    if "fail" in argv:
        def full(p: str) -> None:
            if p == "fsync":
                raise OSError(errno.ENOSPC, "No space left on device (simulated)")

        shard_writer.at_phase = full
    with Held() as held:  # still writing when the script returns
        engine.save_checkpoint(root, tag="last")
        held.release()
    print("script returned", flush=True)
    return 0


def polls_at_boundaries(root: str) -> dict:
    """A pending save is polled (a collective, and on a GPU a host sync) at accumulation boundaries
    only, as DeepSpeed commits a decoupled save there: not at every micro-batch's ``step()``. Two
    micro-batches of one step (DeepSpeed's manual accumulation) with the writer held: one poll."""
    engine = _engine(2, extra={"shardwise": {"async_checkpoint": True}})
    _train(engine, 0, 1)
    ids = torch.randint(0, 64, (1, 8))
    calls, orig = [], async_save.complete

    def counting(block: bool) -> bool:
        calls.append(block)
        return orig(block)

    with Held() as held:
        engine.save_checkpoint(Path(root), tag="p")
        async_save.complete = counting
        try:
            polls = []
            for boundary in (False, True):
                engine.set_gradient_accumulation_boundary(boundary)
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                engine.step()
                polls.append(len(calls))
        finally:
            async_save.complete = orig
            held.release()
        wait_for_checkpoint()
    return {"polls": polls, "latest": (Path(root) / "latest").read_text()}


def failed_write_frees_copy(root: str) -> dict:
    """Rank 1's writer fails (ENOSPC) mid-file: once the error was raised on every rank, the staged
    copy is gone on every rank, not kept until the next save by the error's traceback (whose frames
    hold the pieces): the next save would otherwise stage a second copy beside it."""
    import gc
    import weakref

    from shardwise.checkpoint import save as save_mod

    engine = _engine(2, extra={"shardwise": {"async_checkpoint": True}})
    _train(engine, 0, 1)
    refs, orig_stage, orig_phase = [], save_mod.stage, shard_writer.at_phase

    def recording(pieces, keep=False):
        staged = orig_stage(pieces, keep)
        refs.extend(weakref.ref(t) for _, t in staged.pieces)
        return staged

    def full(p: str) -> None:
        if p == "writing" and dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    save_mod.stage, shard_writer.at_phase = recording, full
    err = None
    try:
        engine.save_checkpoint(Path(root), tag="bad")
        wait_for_checkpoint()
    except CheckpointError as e:
        err = str(e)
    finally:
        save_mod.stage, shard_writer.at_phase = orig_stage, orig_phase
    gc.collect()
    return {"error": err, "staged": len(refs), "alive": sum(r() is not None for r in refs)}


def same_bytes_pp(root: str, stages: int, zero: int = 0) -> dict:
    """:func:`same_bytes` for a pipeline engine (tests/pipeline_cases.py's layers) at ``stages`` stages,
    data-parallel over the rest of the ranks, ZeRO ``zero``: every stage writes its layers' tensors into
    the one folder, the async save's bytes those of the sync save."""
    import torch.nn.functional as F  # noqa: N812
    from pipeline_cases import BASE_SEED, CONFIG, batches, specs

    from shardwise.pipeline import PipelineModule

    model = PipelineModule(specs(), num_stages=stages, loss_fn=F.mse_loss, seed_layers=True,
                           seed_fn=torch.manual_seed, base_seed=BASE_SEED)
    config = {**CONFIG, "zero_optimization": {"stage": zero}}
    engine, *_ = shardwise.initialize(model=model, config=config)
    dp = engine.grid.get_data_parallel_id()

    def train(a: int, b: int) -> None:
        for s in range(a, b):
            engine.train_batch(batches(s, dp, config))

    return _same_bytes_with(engine, train, Path(root))
