"""`shardwise launch`: flags before the target, and restart-and-resume after a killed rank (gloo).

The killed job is a real launch (its processes, their kill and the restart are the subject); the
uninterrupted run it is compared with is the same script on the rank pool's two ranks
(tests/script_cases.py), as the launcher would run it: same world size, same code, same losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rank_pool import RankPool
from script_cases import run_in

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(Path(__file__).resolve().parent / "launch_worker.py")
STEPS = 8


def test_default_rendezvous_restarts_with_a_fresh_store() -> None:
    """One node: c10d rendezvous through the agent's store (what makes restarts work on gloo)."""
    from shardwise.cli.command import _launch_parser, _torchrun_command

    args, rest = _launch_parser().parse_known_args(["--nproc", "2", "--max-restarts", "2", "--log-dir", "x"])
    cmd = _torchrun_command(args, rest)
    assert "--standalone" in cmd and "--max_restarts=2" in cmd and cmd[-2:] == ["--log-dir", "x"]
    args, rest = _launch_parser().parse_known_args(["--rdzv-backend", "c10d"])
    cmd = _torchrun_command(args, rest)
    assert "--rdzv_backend=c10d" in cmd and any(c.startswith("--rdzv_endpoint=127.0.0.1:") for c in cmd)


def _start(out: Path, *flags: str, kill_at: int | None = None) -> subprocess.Popen:
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if kill_at is not None:
        env["KILL_AT"] = str(kill_at)
    with (out / "stderr.txt").open("w") as err:  # a file: no pipe to fill while the other job runs
        return subprocess.Popen([sys.executable, "-m", "shardwise.cli", "launch", "--nproc", "2", *flags, "--",
                                 WORKER, str(out), str(STEPS)], env=env, stdout=subprocess.DEVNULL, stderr=err)


def _losses(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]


@pytest.mark.subprocess
def test_killed_rank_restarts_and_resumes_with_the_same_losses(tmp_path: Path, pool2: RankPool) -> None:
    """Rank 1 is SIGKILLed inside step 5; the job restarts, resumes from the step-4 checkpoint and
    every step's loss equals the uninterrupted run's (the space form of --max-restarts, too)."""
    job = _start(tmp_path / "killed", "--max-restarts", "2", kill_at=5)
    try:
        (tmp_path / "plain").mkdir()
        run_in(pool2, WORKER, [str(tmp_path / "plain"), str(STEPS)])  # while the killed job runs
        job.wait(timeout=400)
        assert job.returncode == 0, (tmp_path / "killed" / "stderr.txt").read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    killed, plain = _losses(tmp_path / "killed"), _losses(tmp_path / "plain")
    assert {e["attempt"] for e in killed} == {0, 1}, killed  # it did restart
    assert {e["attempt"] for e in plain} == {0} and [e["step"] for e in plain] == list(range(STEPS))
    resumed = [e for e in killed if e["attempt"] == 1]
    assert resumed[0]["step"] == 4  # from the latest checkpoint (saved after step 3), not from 0
    last = {e["step"]: e["loss"] for e in killed}  # the last record of each step
    assert sorted(last) == list(range(STEPS))
    assert [last[s] for s in range(STEPS)] == [e["loss"] for e in plain]
