"""Cases for tests/test_rank_pool.py: each leaves a mark a later case could see, or misbehaves."""

from __future__ import annotations

import os
import random
import signal
import tempfile
import time

import torch


def leave_marks(folder: str) -> dict:
    """Change what the pool must undo; report the state this case was given."""
    seen = {"env": os.environ.get("RANK_POOL_MARK"), "cwd": os.getcwd(), "tmp": tempfile.gettempdir(),
            "dtype": str(torch.get_default_dtype()), "grad": torch.is_grad_enabled(),
            "draws": [random.random(), torch.rand(1).item()],
            "sigterm": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL}
    os.environ["RANK_POOL_MARK"] = "left"
    os.chdir(folder)
    open(os.path.join(tempfile.gettempdir(), "left.txt"), "w").close()
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a training loop's own handler would
    return seen


def rank_and_pid() -> tuple[int, int]:
    return int(os.environ["RANK"]), os.getpid()


def hang_on_rank1(seconds: float) -> int:
    """Rank 1 never answers in time (a case stuck outside any collective)."""
    if int(os.environ["RANK"]) == 1:
        time.sleep(seconds)
    return 1


def fail_on_rank0() -> int:
    """Rank 0 raises; rank 1 returns: the ranks no longer agree on where they are."""
    if int(os.environ["RANK"]) == 0:
        raise ValueError("rank 0 fails alone")
    return 1


def fail_everywhere() -> int:
    raise ValueError("every rank fails the same way")


def all_reduce_sum() -> float:
    """A collective over the pool's group: proves the group works."""
    from shardwise.comm import compat

    t = torch.tensor([float(os.environ["RANK"]) + 1.0])
    compat.all_reduce(t)
    return t.item()


def garbage_collected() -> dict:
    """How the rank's collector treats old and new objects (rank_pool._freeze_heap): how many are frozen,
    whether a reference cycle this case makes and drops is freed, and whether ``gc.get_objects()`` lists
    an object this case made."""
    import gc
    import weakref

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a
    alive = weakref.ref(a)
    listed = any(o is b for o in gc.get_objects())
    del a, b
    gc.collect()
    return {"frozen": gc.get_freeze_count(), "cycle_freed": alive() is None, "listed": listed}
