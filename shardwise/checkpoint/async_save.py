"""Asynchronous saves: written by a background thread, published by the main thread.

``save_checkpoint`` with the asynchronous mode on (:func:`async_enabled`) returns once the state is
staged (``checkpoint/staging.py``); a writer thread writes this rank's shard file and manifest,
fsynced, into the partial folder. The thread runs no collective: agreeing that every rank's files
are durable, and publishing, happen on the main thread at points every rank reaches in step
(:func:`complete`): the end of every ``engine.step()`` at an accumulation boundary while a save is
pending (a poll that never waits for a writer), the next save, a load, :func:`wait_for_checkpoint`,
and the process's exit. So the training groups never see a collective from another thread, and no group is made for it.

At most one save is in flight per process: the next save waits for it. A writer's error (a full
disk, an unreadable folder, a writer that has not finished within half the collective timeout) is
raised as the same ``CheckpointError`` on every rank at the first such point after it: the
failing rank's message, broadcast. At exit a pending save is completed; if it fails, the error is
printed and the process exits 1. A process ending on an unhandled exception publishes nothing
(its peers may be anywhere): ``latest`` keeps naming the last complete checkpoint.
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.checkpoint.fileio import agree, world_comm
from shardwise.checkpoint.staging import Staged
from shardwise.comm import collective_timeout, compute_device
from shardwise.errors import one_line


@dataclass
class SaveJob:
    """What one rank's writer and rank 0's publication need: nothing that reads the engine."""

    root: Path
    tmp: Path
    tag: str
    rank: int
    manifest: dict[str, Any]
    meta: dict[str, Any] | None  # rank 0: checkpoint/publish.engine_meta at the call
    client_state: dict
    save_latest: bool
    write: Callable[[Path, int, dict, list], None] = field(repr=False)  # save.write_rank
    publish: Callable[[SaveJob], None] = field(repr=False)  # rank 0: publish.finalize


class PendingSave:
    """One save's background write on this rank (run by the writer thread, :func:`_writer_loop`)."""

    def __init__(self, job: SaveJob, staged: Staged):
        self.job, self.staged = job, staged
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.staged.ready()  # device-to-host copies landed: only then read the buffer
            self.job.write(self.job.tmp, self.job.rank, self.job.manifest, self.staged.pieces)
        except BaseException as e:  # noqa: BLE001 - handed to every rank by complete()
            # the traceback's finished frames hold the pieces (views of the staged buffer): without
            # this, the error (kept by _LAST until the next save) kept the copy alive beside the next one
            traceback.clear_frames(e.__traceback__)
            self.error = e
        finally:
            self.staged.release()  # the snapshot's memory goes back as soon as it is on disk
            self.done.set()

    def state(self) -> int:
        """0 writing, 1 written, 2 failed."""
        if not self.done.is_set():
            return 0
        return 2 if self.error is not None else 1


_QUEUE: queue.SimpleQueue[PendingSave] = queue.SimpleQueue()
_WRITER: list[threading.Thread | None] = [None]


def _writer_loop() -> None:
    """The process's one writer thread, started with its first asynchronous save and kept: starting
    a thread per save made the save call wait for the new thread to be scheduled (0.37 s measured
    on a loaded 2-core host). A daemon: an exit that does not wait for it (a process ending on an
    error) is not held up by a write."""
    while True:
        _QUEUE.get().run()


_PENDING: list[PendingSave | None] = [None]
_LAST: list[PendingSave | None] = [None]  # the last save handed to the writer, published or not
_EXIT_HOOK = [False]


def writer_idle() -> bool:
    """True when the writer has finished with every save handed to it (a kept staging buffer may
    then be written again; a writer given up on after the timeout may still be reading it)."""
    return _LAST[0] is None or _LAST[0].done.is_set()


def keep_buffer(engine: Any) -> bool:
    """``shardwise.keep_checkpoint_buffer`` of ``engine``'s config (False without one)."""
    return bool(getattr(getattr(getattr(engine, "config", None), "shardwise", None), "keep_checkpoint_buffer", False))


def pending_tag() -> str | None:
    """The tag of the save this process is still writing or has not published, else None."""
    p = _PENDING[0]
    return None if p is None else p.job.tag


def pending_state() -> str | None:
    """None (no save pending), "writing", "written" (not yet published) or "failed" (not yet raised)."""
    p = _PENDING[0]
    return None if p is None else ("writing", "written", "failed")[p.state()]


def start(job: SaveJob, staged: Staged) -> None:
    """Hand a staged save to its writer thread (the previous one was completed by the caller)."""
    assert _PENDING[0] is None, "one save in flight at a time: complete(block=True) first"
    if not _EXIT_HOOK[0]:
        _EXIT_HOOK[0] = True
        atexit.register(_at_exit)  # after the comm's teardown was registered: runs before it
    if _WRITER[0] is None or not _WRITER[0].is_alive():
        _WRITER[0] = threading.Thread(target=_writer_loop, name="shardwise-checkpoint-writer", daemon=True)
        _WRITER[0].start()
    _PENDING[0] = _LAST[0] = PendingSave(job, staged)
    _QUEUE.put(_PENDING[0])


def _counts(state: int) -> tuple[int, int]:
    """(ranks whose writer failed, ranks whose writer finished), over every rank."""
    comm = world_comm()
    if comm.size == 1:
        return int(state == 2), int(state >= 1)
    t = torch.tensor([int(state == 2), int(state >= 1)], dtype=torch.int64, device=compute_device())
    comm.all_reduce(t)
    return int(t[0].item()), int(t[1].item())


def writer_wait_limit() -> float:
    """How long a rank waits for its own writer before it joins its peers' collective: half the
    collective timeout. Its peers may already wait in that collective (their writers done), and
    they give up after the collective timeout: a rank that waited the whole timeout (or, as
    before, that twice) would meet peers that had already failed with a collective timeout
    instead of the writer's error."""
    return collective_timeout().total_seconds() / 2


def complete(block: bool) -> bool:
    """Collective (every rank, in step): publish the pending save once every rank's writer is done,
    or raise its failure on every rank. ``block``: wait for this rank's writer (at most
    :func:`writer_wait_limit`, all waits together) instead of returning while one is still writing.
    Returns True when no save is pending any more."""
    p = _PENDING[0]
    if p is None:
        return True
    limit = writer_wait_limit()
    deadline = time.monotonic() + limit  # one budget for both waits below: peers wait in a collective
    if block and not p.done.wait(limit) and p.error is None:
        p.error = TimeoutError(f"the checkpoint writer of {p.job.tag} did not finish within {limit:.0f} s "
                               "(half the collective timeout)")
    state = 2 if p.error is not None else p.state()
    failed, finished = _counts(state)
    world = world_comm().size
    if not failed and finished < world:
        return False
    _PENDING[0] = None
    if failed:
        p.done.wait(max(0.0, deadline - time.monotonic()))  # ours no longer writes into the next save's folder
        agree(world_comm(), p.error, f"save_checkpoint of {p.job.tag} (writing in the background)")
    err = None
    try:
        if p.job.rank == 0:
            p.job.publish(p.job)
    except BaseException as e:  # noqa: BLE001 - re-raised by agree() on every rank
        err = e
    agree(world_comm(), err, f"save_checkpoint of {p.job.tag} (publishing)")
    return True


def poll_checkpoint() -> None:
    """Collective, at a point every rank reaches in step (the end of a boundary's ``engine.step()``): publish the
    pending asynchronous save if every rank has written it, or raise its failure; never waits for
    a writer. Nothing pending: no collective, nothing to do."""
    if _PENDING[0] is not None:
        complete(block=False)


def wait_for_checkpoint() -> None:
    """Collective: finish and publish the pending asynchronous save, if any (or raise its failure
    on every rank). Call it where every rank is, e.g. before ``destroy_process_group``."""
    complete(block=True)


def _at_exit() -> None:
    p = _PENDING[0]
    if p is None:
        return
    if getattr(sys, "last_value", None) is not None or not (dist.is_available() and dist.is_initialized()):
        print(f"shardwise: the asynchronous checkpoint {p.job.tag} was not published (the process is ending "
              f"on an error, or its process group was destroyed first); {p.job.root / 'latest'} names the "
              "last complete one", file=sys.stderr, flush=True)
        if not dist.is_initialized() and getattr(sys, "last_value", None) is None:
            _exit_now(1)
        return
    try:
        complete(block=True)
    except BaseException as e:  # noqa: BLE001 - an exit handler cannot raise: printed, exit 1
        print(f"shardwise: error: {one_line(e)}", file=sys.stderr, flush=True)
        _exit_now(1)


def _exit_now(code: int) -> None:
    """A non-zero exit from an exit handler (Python ignores SystemExit raised there)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def async_enabled(engine: Any) -> bool:
    """Whether ``engine``'s saves are asynchronous: ``shardwise.async_checkpoint`` when set (true or
    false), else DeepSpeed's switches: ``checkpoint.writer.decoupled: true`` or a ``datastates_ckpt``
    section (DeepSpeed turns DataStates on for any value but ``false``)."""
    cfg = getattr(engine, "config", None)
    if cfg is None:
        return False
    own = getattr(getattr(cfg, "shardwise", None), "async_checkpoint", None)
    if own is not None:
        return bool(own)
    writer = (getattr(cfg, "checkpoint", None) or {}).get("writer")
    if isinstance(writer, dict) and writer.get("decoupled") is True:
        return True
    return getattr(cfg, "datastates_ckpt", None) not in (None, False)
