"""A script that ends without destroying the process group exits 0, under CPU load, every time.

Issue 11 item 9: such scripts sometimes died at exit with SIGABRT ("terminate called without an
active exception") after a successful run. shardwise's atexit teardown (shardwise/comm/core.py) waits
for pending collectives, destroys the group it created and lets gloo's worker threads finish
freeing their last work before the interpreter finalizes (the abort was a worker asking for the GIL
during finalization, caught in gdb); after an unhandled exception it ends the process at once
(exit 1). Each run here is a real 2-rank job. The resumed DeepSpeed-style example aborted in 5 of
18 runs on this machine before that fix, and 0 of 30 after.

The other half, TP and ZeRO-2 scripts and a failing one beside a busy loop, is
tests/test_launch_exit_load.py: a file of its own, so that the two halves, the suite's last files
(tests/worker_plan.py), run on both workers at once instead of one after the other on one.
"""

from __future__ import annotations

import sys

import pytest
from side_by_side import ROOT, RUNS, side_by_side


@pytest.mark.subprocess
def test_deepspeed_example_ending_in_all_reduce_exits_0_every_time(tmp_path) -> None:
    """The saving run first, then its resumes side by side (they only read the checkpoint)."""
    ex = ROOT / "examples" / "deepspeed_scripts"
    common = [sys.executable, "-m", "shardwise.cli", "launch", "--nproc", "2", str(ex / "checkpoint_resume.py"),
              "--deepspeed_config", str(ex / "ds_config.json"), "--ckpt_dir", str(tmp_path)]
    runs = side_by_side([common + ["--save_at", "3"]]) + side_by_side([common + ["--resume"]] * RUNS)
    for i, r in enumerate(runs):
        failure = f"run {i}: exit {r.returncode}\n{r.stderr[-3000:]}"
        assert r.returncode == 0 and "terminate called" not in r.stderr, failure
        assert "samples seen 128 global steps 8" in r.stdout, r.stdout[-2000:]
