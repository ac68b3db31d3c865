"""The GPU tier (`make test-gpu`; skipped, with the reason, everywhere else): the main job on one GPU,
two ranks asked of one GPU refused in one line, CPU ranks on a GPU machine, a torchrun rank without a
GPU of its own refused before any CUDA call, and ``benchmarks/gpu_check.py --smoke`` on CUDA.

Each runs with ``CUDA_VISIBLE_DEVICES`` set to the first GPU, so a machine with several GPUs tests the
one-GPU case too. (The device guard on real CUDA is in the same tier by its ``gpu`` marker.)
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["--steps", "4", "--eval-every", "0", "--sample-tokens", "0", "--no-export", "--save-every", "4"]

pytestmark = pytest.mark.gpu


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0", **env}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=900)


def _main_job(out: Path, *flags: str) -> subprocess.CompletedProcess:
    return _run(["-m", "shardwise.cli", "launch", *flags, "--", "train", "--run-config", "examples/sonnets.toml",
                 *SHORT, "--out", str(out)])


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in rows if r.get("kind") == "train"]


def test_main_job_on_one_gpu(tmp_path) -> None:
    r = _main_job(tmp_path / "run")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "shardwise launch: 1 rank on NCCL, one GPU each (1 GPU visible" in r.stderr and "world 1 (" in r.stdout
    losses = _losses(tmp_path / "run")
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses


def test_two_ranks_on_one_gpu_refused_in_one_line(tmp_path) -> None:
    r = _main_job(tmp_path / "run", "--nproc", "2")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("shardwise launch: error: --nproc 2: 2 ranks on this node but 1 GPU visible")
    assert not (tmp_path / "run").exists()  # refused before any rank started


def test_cpu_ranks_on_a_gpu_machine(tmp_path) -> None:
    r = _main_job(tmp_path / "run", "--nproc", "2", "--backend", "gloo")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "2 CPU ranks on gloo" in r.stderr and len(_losses(tmp_path / "run")) == 4


def test_torchrun_rank_without_its_own_gpu_refused(tmp_path) -> None:
    """What plain torchrun --nproc_per_node 2 starts as rank 1 on one GPU: one line, exit 2."""
    r = _run(["-m", "shardwise.cli", "train", "--run-config", "examples/sonnets.toml", *SHORT, "--out",
              str(tmp_path / "run")], RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
             MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]  # (a library's warning aside)
    assert len(errors) == 1 and errors[0].startswith("shardwise train: error: LOCAL_RANK=1 under NCCL but 1 GPU "
                                                     "visible"), r.stderr[-3000:]


def test_gpu_check_smoke_on_cuda(tmp_path) -> None:
    r = _run([str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(tmp_path)])
    assert r.returncode == 0, r.stderr[-3000:]
    sections = json.loads((tmp_path / "gpu_check_smoke.json").read_text())["sections"]
    assert all(sec["status"] in ("ok", "skipped") for sec in sections.values()), sections  # none failed
    assert sections["offload_bandwidth"]["status"] == "ok", sections  # skipped only where there is no CUDA
