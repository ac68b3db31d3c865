"""Crash consistency of asynchronous saves (issue 58 item 5): a rank SIGKILLed while the second save
of a `shardwise train` run (asynchronous by default) is staging, writing, fsyncing or publishing
leaves ``latest`` naming the complete first one; every rank ends (none hangs); ``--resume auto``
continues from it with the uninterrupted run's losses, bit for bit.

The killed jobs are processes (their SIGKILL and exits are the subject), forked from the suite's
server (``fresh_ranks.py``), the four side by side; the uninterrupted run and the resumes run in the
2-rank pool.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from rank_pool import RankPool

from shardwise.launch.net import free_port
from shardwise.train.outputs import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fresh_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DS = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
# (phase, the rank killed): only rank 0 publishes
PHASES = [("staging", "1"), ("writing", "1"), ("fsync", "1"), ("publishing", "0")]
TIMEOUT_S = 15


def _args(tmp: Path, out: Path, *extra: str) -> list[str]:
    cfg = tmp / "ds.json"
    cfg.write_text(json.dumps(DS))
    return ["--config", str(cfg), "--model", "llama-micro", "--seq", "32", "--steps", "3", "--save-every", "1",
            "--keep", "0", "--eval-every", "0", "--eval-fraction", "0", "--sample-tokens", "0", "--no-export",
            "--timeout", str(TIMEOUT_S), "--out", str(out), *extra]


def _losses(out: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(out) if m["kind"] == "train"}


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> dict[str, tuple[Path, list[tuple[int, str]]]]:
    """Each phase's killed job: (its run folder, each rank's (exit code, stderr))."""
    tmp = tmp_path_factory.mktemp("crash")
    jobs = {}
    for phase, victim in PHASES:
        port, out = str(free_port()), tmp / phase / "run"
        (tmp / phase).mkdir()
        procs = []
        for rank in range(2):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": port, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "CRASH_PHASE": phase, "CRASH_RANK": victim}
            procs.append(fresh_ranks.start("async_ckpt_cases:killed_at_phase", _args(tmp / phase, out), env,
                                           tmp / phase / f"rank{rank}"))
        jobs[phase] = (out, procs)
    deadline = time.time() + 300
    while time.time() < deadline and any(p.poll() is None for _, ps in jobs.values() for p in ps):
        time.sleep(0.1)
    res = {}
    for phase, (out, procs) in jobs.items():
        for p in procs:
            if p.poll() is None:
                p.kill()
        res[phase] = (out, [(p.wait(), p.communicate()[1]) for p in procs])
    return res


@pytest.fixture(scope="module")
def straight(tmp_path_factory, pool2: RankPool) -> dict[int, float]:
    tmp = tmp_path_factory.mktemp("straight")
    for rank, (code, out, err) in enumerate(pool2.run("train_cases:train", _args(tmp, tmp / "run"))):
        assert code == 0, (rank, out[-2000:], err[-2000:])
    return _losses(tmp / "run")


@pytest.mark.subprocess
@pytest.mark.parametrize(("phase", "victim"), PHASES)
def test_a_rank_killed_in_each_phase_leaves_latest_complete_and_resumes(crashed, straight, pool2, tmp_path,
                                                                         phase, victim):
    out, ranks = crashed[phase]
    v = int(victim)
    assert ranks[v][0] == -9 and f"SIGKILLed in {phase}" in ranks[v][1], ranks[v][1][-3000:]
    assert ranks[1 - v][0] not in (0, None), ranks[1 - v][1][-3000:]  # the survivor ended, with an error
    ckpt = out / "checkpoints"
    assert (ckpt / "latest").read_text() == "global_step1"
    meta = json.loads((ckpt / "global_step1" / "metadata.json").read_text())
    for name, f in meta["files"].items():
        assert (ckpt / "global_step1" / name).stat().st_size == f["bytes"]
    assert not (ckpt / "global_step2").exists()
    answers = pool2.run("train_cases:train", _args(tmp_path, out, "--resume", "auto"))
    for rank, (code, o, e) in enumerate(answers):
        assert code == 0, (rank, o[-2000:], e[-2000:])
    assert _losses(out) == straight  # steps 2 and 3 again from the complete step-1 checkpoint
    assert (ckpt / "latest").read_text() == "global_step3" and not list(ckpt.glob(".*.partial"))


@pytest.mark.subprocess
def test_exit_completes_a_pending_save_or_fails_with_its_error(tmp_path):
    """A script returning with a save still pending: the exit publishes it (exit 0), or reports its
    writer's failure (exit 1, the error on stderr), never exit 0 with the save lost."""
    procs = {}
    for how in ("ok", "fail"):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
        procs[how] = fresh_ranks.start("async_ckpt_cases:exit_pending", [str(tmp_path / how), how], env,
                                       tmp_path / f"proc_{how}")
    res = {how: (p.wait(timeout=120), *p.communicate()) for how, p in procs.items()}
    code, out, err = res["ok"]
    assert code == 0 and "script returned" in out, err[-3000:]
    assert (tmp_path / "ok" / "latest").read_text() == "last" and (tmp_path / "ok" / "last" / "metadata.json").is_file()
    code, out, err = res["fail"]
    assert code == 1 and "script returned" in out, (code, err[-3000:])
    assert "shardwise: error:" in err and "No space left on device" in err, err[-3000:]
    assert not (tmp_path / "fail" / "latest").exists()
