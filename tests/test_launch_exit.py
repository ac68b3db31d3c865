"""A script that ends without destroying the process group exits 0, under CPU load, every time.

Issue 11 item 9: such scripts sometimes died at exit with SIGABRT ("terminate called without an
active exception") after a successful run. shardwise's atexit teardown (shardwise/comm/core.py) waits
for pending collectives, destroys the group it created and lets gloo's worker threads finish
freeing their last work before the interpreter finalizes (the abort was a worker asking for the GIL
during finalization, caught in gdb); after an unhandled exception it ends the process at once
(exit 1). Each run here is a real 2-rank job. The resumed DeepSpeed-style example aborted in 5 of
18 runs on this machine before that fix, and 0 of 30 after.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(Path(__file__).resolve().parent / "exit_worker.py")
# Three clean runs per test (the abort came in 5 of 18 runs before the fix, so three runs of the
# old code all exit 0 with probability (13/18)**3 = 0.38 per test, 0.14 for both tests together);
# SHARDWISE_EXIT_RUNS=30 repeats the thorough check.
RUNS = int(os.environ.get("SHARDWISE_EXIT_RUNS", "3"))


def _torchrun(mode: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           WORKER, mode], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.subprocess
def test_deepspeed_example_ending_in_all_reduce_exits_0_every_time(tmp_path) -> None:
    ex = ROOT / "examples" / "deepspeed_scripts"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    common = [sys.executable, "-m", "shardwise.cli", "launch", "--nproc", "2", str(ex / "checkpoint_resume.py"),
              "--deepspeed_config", str(ex / "ds_config.json"), "--ckpt_dir", str(tmp_path)]
    runs = [common + ["--save_at", "3"]] + [common + ["--resume"]] * RUNS
    for i, cmd in enumerate(runs):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        failure = f"run {i}: exit {r.returncode}\n{r.stderr[-3000:]}"
        assert r.returncode == 0 and "terminate called" not in r.stderr, failure
        assert "samples seen 128 global steps 8" in r.stdout, r.stdout[-2000:]


@pytest.mark.subprocess
def test_runs_exit_0_under_load_and_errors_never_abort() -> None:
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        for i in range(RUNS):
            r = _torchrun("tp" if i % 2 == 0 else "zero")
            assert r.returncode == 0, f"run {i}: exit {r.returncode}\n{r.stderr[-3000:]}"
            assert "terminate called" not in r.stderr
        r = _torchrun("error")  # a clean error in rank 1: the job fails, but no rank dies of SIGABRT
        assert r.returncode == 1 and "a clean error in rank 1" in r.stderr, r.stderr[-3000:]
        assert "exitcode: -6" not in r.stderr and "terminate called" not in r.stderr, r.stderr[-3000:]
    finally:
        burner.kill()
        burner.wait()
