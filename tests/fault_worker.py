"""One rank of a `shardwise train` job with a fault injected into one rank (the fault tests' worker).

``run_rank(TRAIN_ARGS)`` (in a rank forked by ``fresh_ranks.start``, or ``python fault_worker.py
TRAIN_ARGS...``) runs ``shardwise train`` in this process (RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set by the test, no launcher), after wrapping one entry point:
``FAULT="TARGET:ACTION"`` on rank ``FAULT_RANK``, armed once the first checkpoint is saved (so the
run folder holds a complete one), at the ``FAULT_CALL``-th call of TARGET after that (default 1):

- TARGET ``all_to_all`` (Ulysses' exchange), ``all_to_all_v`` (expert dispatch/combine, ring passes),
  ``all_gather`` (ZeRO's gathers), ``forward``, ``backward``, ``step`` (the engine's);
- ACTION ``kill`` (SIGKILL, mid-call), ``stall`` (sleep, then go on) or ``oom`` (raise
  ``torch.OutOfMemoryError`` as the CUDA caching allocator does). A stall lasts ``FAULT_STALL_S``, or
  less where the test names a file ``FAULT_RESUME_FILE`` that it creates once every other rank has
  ended: the stalled rank then resumes into a collective its peers have already given up on, which is
  the case under test, without waiting out a fixed sleep chosen for the slowest host.

Before acting the rank prints ``fault: rank R ACTION in TARGET at T`` (T: ``time.time()``) on stderr.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import signal
import sys
import time

import torch

from shardwise.cli.train import main
from shardwise.comm import Comm
from shardwise.engine import Engine

TARGETS = {"all_to_all": Comm, "all_to_all_v": Comm, "all_gather": Comm, "forward": Engine, "backward": Engine,
           "step": Engine}
STATE = {"armed": False, "calls": 0}


def _act(target: str, action: str) -> None:
    rank = int(os.environ["RANK"])
    print(f"fault: rank {rank} {action} in {target} at {time.time():.3f}", file=sys.stderr, flush=True)
    faulthandler.dump_traceback_later(float(os.environ.get("FAULT_STALL_S", "8")) + 60, exit=True)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stall":
        _stall(float(os.environ.get("FAULT_STALL_S", "8")), os.environ.get("FAULT_RESUME_FILE"))
    elif action == "oom":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")


def _stall(limit_s: float, resume_file: str | None) -> None:
    """Sleep ``limit_s``, or until ``resume_file`` exists (the peers have ended), whichever is first."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end and not (resume_file and os.path.exists(resume_file)):
        time.sleep(0.1)


def _install(target: str, action: str, nth: int) -> None:
    owner = TARGETS[target]
    original = getattr(owner, target)

    @functools.wraps(original)
    def wrapped(self, *args, **kwargs):
        if STATE["armed"]:
            STATE["calls"] += 1
            if STATE["calls"] == nth:
                _act(target, action)
        return original(self, *args, **kwargs)

    setattr(owner, target, wrapped)
    save = Engine.save_checkpoint

    @functools.wraps(save)
    def saved(self, *args, **kwargs):
        out = save(self, *args, **kwargs)
        STATE["armed"] = True
        return out

    Engine.save_checkpoint = saved


def run_rank(argv: list[str]) -> int:
    """This rank's ``shardwise train`` with the fault installed where the environment asks; its exit
    code (what ``python fault_worker.py ARGS`` exits with, and ``fresh_ranks.start``'s rank too)."""
    faulthandler.dump_traceback_later(600, exit=True)  # a hang shows where (re-armed at the fault)
    fault = os.environ.get("FAULT")
    if fault and os.environ.get("RANK") == os.environ.get("FAULT_RANK", "1"):
        name, act = fault.split(":")
        _install(name, act, int(os.environ.get("FAULT_CALL", "1")))
    return main(argv)


if __name__ == "__main__":
    sys.exit(run_rank(sys.argv[1:]))
