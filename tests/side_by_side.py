"""Launches run at the same time, for the exit tests (tests/test_launch_exit*.py): each command is its own
launcher and ranks (ports of their own), and together they are the CPU load the exit abort needed
(issue 11 item 9: two ranks a job on 2 cores)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Three clean runs per test (the abort came in 5 of 18 runs before the fix, so three runs of the
# old code all exit 0 with probability (13/18)**3 = 0.38 per test, 0.14 for both tests together);
# SHARDWISE_EXIT_RUNS=30 repeats the thorough check.
RUNS = int(os.environ.get("SHARDWISE_EXIT_RUNS", "3"))
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def side_by_side(cmds: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Run the commands at the same time and wait for all (at most 300 s each)."""
    procs = [subprocess.Popen(c, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
    done = []
    try:
        for cmd, p in zip(cmds, procs, strict=True):
            out, err = p.communicate(timeout=300)
            done.append(subprocess.CompletedProcess(cmd, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done
