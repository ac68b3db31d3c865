"""Run test functions on N gloo ranks that stay up for the whole pytest session.

Starting ranks costs seconds each (importing torch and transformers), so a pool
of N processes is started once, its ranks forked from the suite's forkserver that
has already done those imports (tests/fresh_ranks.py); a test sends ``"module:function"`` plus
arguments to every rank and gets each rank's return value back. A test whose
ranks must fail a collective (which leaves the gloo group unusable) runs in a
fresh pool via :func:`run_fresh`.

Between cases every rank is put back as the case found it (:func:`_reset_after`):
environment variables, working directory, a temporary folder of the case's own
(removed after), default dtype, grad mode and signal handlers; the RNGs are seeded the same before
every case, so a case's numbers never depend on which cases ran before it. The
process groups shardwise makes (``shardwise.layout`` caches them by shape) are reused
across cases. A case that fails on only some ranks, fails with a distributed
error, or gives no answer within its timeout may have left the group unusable or a
rank still busy, so the pool is killed and started again before the next case:
the failure stays the failing test's, never the next one's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any

import fresh_ranks

from shardwise.launch.net import free_port

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_READY = "rank ready"  # each rank's first message, once it has joined the group
# Words in a rank's traceback that say the group itself failed (a timeout, a peer gone, a
# desync), after which the next collective could hang or pair with a stale one.
_GROUP_FAILURE = ("gloo", "Timed out", "timed out", "Connection", "diverged", "DistBackendError",
                  "DistNetworkError", "ProcessGroup")


def _seed_all() -> None:
    """The same RNG state before every case (torch, numpy, random), whatever ran before."""
    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _reset_after(env: dict[str, str], cwd: str, case_tmp: str, handlers: list) -> None:
    """Undo what a case may have changed in this process: environment, folder, temp dir, torch
    modes, and the SIGTERM/SIGINT handlers (a training loop installs its own)."""
    import torch

    for sig, handler in zip(_SIGNALS, handlers, strict=True):
        signal.signal(sig, handler)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    tempfile.tempdir = None
    shutil.rmtree(case_tmp, ignore_errors=True)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)


def _run_case(target: str, args: tuple, kwargs: dict) -> Any:
    """One case with a clean slate: seeded RNGs, a temp folder of its own, state restored after."""
    import importlib

    env, cwd, handlers = dict(os.environ), os.getcwd(), [signal.getsignal(s) for s in _SIGNALS]
    case_tmp = tempfile.mkdtemp(prefix="rank_case_")
    tempfile.tempdir = case_tmp
    os.environ["TMPDIR"] = case_tmp
    _seed_all()
    try:
        mod_name, fn_name = target.split(":")
        return getattr(importlib.import_module(mod_name), fn_name)(*args, **kwargs)
    finally:
        _reset_after(env, cwd, case_tmp, handlers)


def _warm_imports() -> None:
    """Import what nearly every case needs (the engine, checkpoints, the train job, a HF model class)
    while the pool starts, so the first case of the session pays for its work, not for these imports
    (the suite counts a pool's start apart from the tests' own time). Only a pool's first start
    does it: a restart after a broken case (and ``run_fresh``'s short-lived pools) skips it."""
    from transformers import LlamaForCausalLM  # noqa: F401

    import shardwise.engine  # noqa: F401
    import shardwise.train.run  # noqa: F401


def _freeze_heap() -> None:
    """Leave what the rank holds now (the forkserver's imports: ~370,000 objects with torch and
    transformers) out of every later garbage collection. A full collection walked them all, 0.19 CPU s
    each, and wrote to their headers, copying the pages shared with the server; a case's
    ``gc.collect()`` (tests/stage3_cases.py's live-storage check makes three a rank) then cost: that
    case took 0.97 CPU s a rank, 0.06 frozen (2026-12-06). Objects made by the cases stay collectable and
    visible to ``gc.get_objects()``; only the session's pools freeze (``run_fresh``'s and the fresh
    ranks' memory measurements see a heap like a new process's)."""
    import gc

    gc.freeze()


def _worker(rank: int, world: int, port: int, timeout_s: float, inbox: mp.Queue, outbox: mp.Queue,
            warm: bool = False, ignored: tuple[int, ...] = (), freeze: bool = False) -> None:
    fresh_ranks.fresh_signal_handlers(list(ignored))  # as a spawned interpreter would start
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    # torch.compile's cache where torch puts it by default (the system temp folder), not in a
    # case's own temp folder: compiled kernels are reused across cases, as in one long process
    import getpass

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(),
                                                                  f"torchinductor_{getpass.getuser()}"))
    sys.path.insert(0, TESTS_DIR)
    import torch

    torch.set_num_threads(1)
    import shardwise

    try:
        shardwise.init_distributed(backend="gloo", timeout=timeout_s)
        if warm:
            _warm_imports()
    except Exception:  # noqa: BLE001
        outbox.put((rank, False, traceback.format_exc()))
        return
    if freeze:
        _freeze_heap()
    outbox.put((rank, True, _READY))
    while True:
        msg = inbox.get()
        if msg is None:
            break
        try:
            outbox.put((rank, True, _run_case(*msg)))
        except BaseException:  # noqa: BLE001
            outbox.put((rank, False, traceback.format_exc()))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class RankError(AssertionError):
    pass


class RankPool:
    """N ranks joined in one gloo group, taking work from the test process.

    ``starts`` counts how often ranks were (re)started and ``start_s`` the seconds the tests
    waited for them to join (interpreter start, imports, the group's rendezvous), for the
    suite's closing summary (tests/conftest.py).
    """

    starts = 0
    start_s = 0.0

    def __init__(self, world: int, timeout_s: float = 120.0, warm: bool = False):
        self.world = world
        self.timeout_s = timeout_s
        self.warm = warm  # the session's pools pre-import what cases need (see _warm_imports)
        # ranks are forked from the suite's forkserver, its imports done (tests/fresh_ranks.py): a start
        # costs a fork and the rendezvous, not ~4.5 CPU s of imports a rank (what a process would read
        # from its environment at start, a case sets itself: glibc's mmap threshold with mallopt)
        self.started = False
        self.procs: list[Any] = []
        self._start()

    def _start(self) -> None:
        self._t0 = time.perf_counter()
        self._joined = False
        ctx = fresh_ranks.context()
        port = free_port()
        self.inboxes = [ctx.Queue() for _ in range(self.world)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, daemon=True,
                                  args=(r, self.world, port, self.timeout_s, self.inboxes[r], self.outbox,
                                        self.warm and not self.started, tuple(fresh_ranks.ignored_here()),
                                        self.warm))
                      for r in range(self.world)]
        for p in self.procs:
            p.start()
        self.started = True
        RankPool.starts += 1

    def _await_join(self, timeout: float) -> None:
        """Wait for every rank's ready message (or its failure to join the group)."""
        errors = []
        for _ in range(self.world):
            try:
                rank, ok, val = self.outbox.get(timeout=timeout)
            except queue.Empty:
                self._kill()
                raise RankError(f"the pool's {self.world} ranks did not start within {timeout}s") from None
            if not ok:
                errors.append(f"--- rank {rank} ---\n{val}")
        RankPool.start_s += time.perf_counter() - self._t0
        if errors:
            self._kill()
            raise RankError("the pool's ranks failed to start:\n" + "\n".join(errors))
        self._joined = True

    def _kill(self) -> None:
        """End every rank now (a case hung or broke the group): nothing of it reaches the next case."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=20)
        self.procs = []

    def run(self, target: str, *args: Any, timeout: float = 600, **kwargs: Any) -> list[Any]:
        """Run ``module:function(*args, **kwargs)`` on every rank; return results by rank.

        Raises :class:`RankError` naming the failing ranks (each rank's traceback) or, after
        ``timeout`` seconds without every answer, the ranks that did not answer; in either case
        the pool is restarted first when the group may be unusable.
        """
        if not self.procs:
            self._start()
        if not self._joined:
            self._await_join(max(timeout, self.timeout_s))
        for q in self.inboxes:
            q.put((target, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world:
            try:  # polled: a silent rank whose process is gone will never answer, so its wait ends early
                rank, ok, val = self.outbox.get(timeout=min(max(deadline - time.monotonic(), 0.01), 0.5))
            except queue.Empty:
                silent = [r for r in range(self.world) if r not in results and r not in errors]
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if time.monotonic() < deadline and not set(silent) <= set(dead):
                    continue
                self._kill()
                raise RankError(f"{target}: no answer within {timeout}s from ranks {silent} "
                                f"(dead ranks: {dead}); the pool was restarted") from None
            (results if ok else errors)[rank] = val
        if errors:
            if len(errors) < self.world or any(w in tb for tb in errors.values() for w in _GROUP_FAILURE):
                self._kill()
            raise RankError(f"{target} failed:\n" + "\n".join(f"--- rank {r} ---\n{tb}"
                                                                for r, tb in sorted(errors.items())))
        return [results[r] for r in range(self.world)]

    def close(self) -> None:
        for q in self.inboxes if self.procs else []:
            q.put(None)
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
        self.procs = []


def run_fresh(world: int, target: str, *args: Any, timeout_s: float = 60.0, **kwargs: Any) -> list[Any]:
    """Run on a pool of its own, closed afterwards (for tests that break the group or need new processes)."""
    pool = RankPool(world, timeout_s=timeout_s)
    try:
        return pool.run(target, *args, **kwargs)
    finally:
        pool.close()
