"""Run test functions on N gloo ranks that stay up for the whole pytest session.

Starting ranks costs seconds each (importing torch and transformers), so a pool
of N processes is started once; a test sends ``"module:function"`` plus
arguments to every rank and gets each rank's return value back. A test whose
ranks must fail a collective (which leaves the gloo group unusable) runs in a
fresh pool via :func:`run_fresh`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import traceback
from typing import Any

from shardwise.net import free_port

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _worker(rank: int, world: int, port: int, timeout_s: float, inbox: mp.Queue, outbox: mp.Queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    sys.path.insert(0, TESTS_DIR)
    import importlib

    import torch

    torch.set_num_threads(1)
    import shardwise

    try:
        shardwise.init_distributed(backend="gloo", timeout=timeout_s)
    except Exception:  # noqa: BLE001
        outbox.put((rank, False, traceback.format_exc()))
        return
    while True:
        msg = inbox.get()
        if msg is None:
            break
        target, args, kwargs = msg
        try:
            mod_name, fn_name = target.split(":")
            fn = getattr(importlib.import_module(mod_name), fn_name)
            outbox.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001
            outbox.put((rank, False, traceback.format_exc()))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class RankError(AssertionError):
    pass


class RankPool:
    """N ranks joined in one gloo group, taking work from the test process."""

    def __init__(self, world: int, timeout_s: float = 120.0):
        ctx = mp.get_context("spawn")
        self.world = world
        port = free_port()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, world, port, timeout_s, self.inboxes[r], self.outbox))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, target: str, *args: Any, timeout: float = 600, **kwargs: Any) -> list[Any]:
        """Run ``module:function(*args, **kwargs)`` on every rank; return results by rank."""
        for q in self.inboxes:
            q.put((target, args, kwargs))
        results: dict[int, Any] = {}
        errors = []
        for _ in range(self.world):
            try:
                rank, ok, val = self.outbox.get(timeout=timeout)
            except Exception as e:  # queue.Empty
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                raise RankError(f"{target}: no answer within {timeout}s (dead ranks: {dead})") from e
            if ok:
                results[rank] = val
            else:
                errors.append(f"--- rank {rank} ---\n{val}")
        if errors:
            raise RankError(f"{target} failed:\n" + "\n".join(errors))
        return [results[r] for r in range(self.world)]

    def close(self) -> None:
        for q in self.inboxes:
            q.put(None)
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()


def run_fresh(world: int, target: str, *args: Any, timeout_s: float = 60.0, **kwargs: Any) -> list[Any]:
    """Run on a pool of its own, closed afterwards (for tests that break the group)."""
    pool = RankPool(world, timeout_s=timeout_s)
    try:
        return pool.run(target, *args, **kwargs)
    finally:
        pool.close()
