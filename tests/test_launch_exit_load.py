"""2-rank scripts that end without destroying the process group (TP=2; ZeRO-2 with overlapped
reduction and a tqdm bar) exit 0 under CPU load, and a clean error in one rank never aborts.

Split from tests/test_launch_exit.py (the issue, the fix and the DeepSpeed example are described
there), so that the two files run on both workers at once at the end of the suite.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from side_by_side import RUNS, side_by_side

WORKER = str(Path(__file__).resolve().parent / "exit_worker.py")


def _torchrun(mode: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER, mode]


@pytest.mark.subprocess
def test_runs_exit_0_under_load_and_errors_never_abort() -> None:
    """The clean runs and the failing one at the same time, with a busy loop beside them: 7 busy
    processes on the host's cores while each job ends. The loop runs at the lowest priority: it keeps
    a core busy whenever the jobs leave one idle (the load the abort needed) without taking CPU time
    from them or from the rest of the suite running beside this test."""
    burner = subprocess.Popen([sys.executable, "-c", "import os; os.nice(19)\nwhile True: pass"])
    try:
        *clean, r = side_by_side([_torchrun("tp" if i % 2 == 0 else "zero") for i in range(RUNS)]
                                 + [_torchrun("error")])
    finally:
        burner.kill()
        burner.wait()
    for i, c in enumerate(clean):
        assert c.returncode == 0, f"run {i}: exit {c.returncode}\n{c.stderr[-3000:]}"
        assert "terminate called" not in c.stderr
    # a clean error in rank 1: the job fails, but no rank dies of SIGABRT
    assert r.returncode == 1 and "a clean error in rank 1" in r.stderr, r.stderr[-3000:]
    assert "exitcode: -6" not in r.stderr and "terminate called" not in r.stderr, r.stderr[-3000:]
