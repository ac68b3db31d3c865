"""A rank killed, stalled or out of memory in the middle of a step (issue 46): every rank ends, each
with one line, within the collective timeout, and the run folder keeps its last complete checkpoint.

The ranks are plain processes (RANK, WORLD_SIZE, MASTER_* set here, no launcher: nothing else ends a
rank that would hang) running ``shardwise train`` through ``fault_worker.run_rank``, which injects the
fault on rank 1 after the step-1 checkpoint. They are forked from a server that has imported torch,
transformers and shardwise (``fresh_ranks.py``: the process, its exit code, SIGKILL and output are
the subject, the imports are not), each with its own environment, argv and stdout/stderr files, and
ending on the interpreter's exit path (atexit teardown included). Timeout 15 s (the groups the run
creates get it too, and 4 ranks starting on a loaded 2-core host reach them seconds apart): a
stalled rank is waited for that long, then its peers end with the diverged-ranks line naming the
collective and themselves (exit 4); the stalled rank, resuming once they have all ended (at most 40
s: a stall shorter than the timeout is no fault, a peer that reaches the collective seconds late on
a loaded host waits less), finds them gone and ends the same
way.
``SLACK_S`` (8 s) covers a rank's own exit on this shared 2-core host (torch and transformers loaded).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from shardwise.launch.net import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fresh_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S, STALL_S, SLACK_S = 15, 40, 8
# synchronous saves: the step-1 checkpoint is published before the fault is armed (shardwise train's
# asynchronous saves and a rank killed while one is pending: tests/test_async_ckpt_crash.py)
DS = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
      "shardwise": {"async_checkpoint": False}}

# Each case is about rank processes dying or stalling: the process is the subject (docs/testing.md).
pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> Path:
    """A tiny Mixtral (4 experts) with a word-level tokenizer, for expert parallelism."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from inference_cases import save_tokenizer
    from moe_cases import VOCAB, build

    folder = tmp_path_factory.mktemp("moe") / "mixtral"
    build("mixtral").save_pretrained(folder)
    save_tokenizer(str(folder), VOCAB)
    return folder


def _launch(tmp: Path, world: int, ds: dict, fault: str, model: str, extra: dict[str, str] | None = None):
    """Start ``world`` ranks of a 3-step run saving every step; returns (processes, run folder, start)."""
    cfg, out = tmp / "ds.json", tmp / "run"
    cfg.write_text(json.dumps(ds))
    args = ["--config", str(cfg), "--model", model, "--seq", "32", "--steps", "3",
            "--save-every", "1", "--keep", "0", "--eval-every", "0", "--eval-fraction", "0", "--sample-tokens",
            "0", "--no-export", "--timeout", str(TIMEOUT_S), "--out", str(out)]
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "FAULT": fault, "FAULT_RANK": "1", "FAULT_STALL_S": str(STALL_S),
               "FAULT_RESUME_FILE": str(tmp / "peers_ended"), **(extra or {})}
        procs.append(fresh_ranks.start("fault_worker:run_rank", args, env, tmp / f"rank{rank}"))
    assert fresh_ranks.server_threads() == 1  # torch, transformers, shardwise imported: no thread before fork
    return procs, out


def _finish(procs: list[fresh_ranks.Rank], out: Path) -> list[tuple[int, str, float]]:
    """(exit code, stderr, time.time() at exit) per rank; every rank killed after 400 s (a hang fails;
    the start of 4 ranks on a loaded 2-core host alone can take a minute, so the bound that matters is
    the one :func:`_check` puts on the time from the fault to each rank's end). Once every rank but the
    faulty one has ended, the file a stalled rank waits for is created (``fault_worker._stall``)."""
    ended: dict[int, float] = {}
    deadline = time.time() + 400
    while len(ended) < len(procs) and time.time() < deadline:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.time()
        if set(ended) >= set(range(len(procs))) - {1}:
            (out.parent / "peers_ended").touch()
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    results = []
    for i, p in enumerate(procs):
        _, err = p.communicate()
        results.append((p.returncode, err, ended.get(i, float("inf"))))
    return results


def _errors(err: str) -> list[str]:
    """stderr without the injection's note, log lines, warnings and progress bars (transformers' loading)."""
    skip = ("fault:", "[shardwise")
    return [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and not ln.startswith(skip)
            and "warn" not in ln.lower() and not re.search(r"\d%\|", ln)]


def _check(res, out: Path, faulty_code: int, line_for: dict[int, str]) -> None:
    """Every rank ended within the timeout of the fault (plus the stall, for the stalled rank itself),
    with one line; the run folder's latest is the complete step-1 checkpoint."""
    fault_at = [float(m.group(1)) for _, err, _ in res for m in [re.search(r"^fault: .* at ([\d.]+)$", err, re.M)]
                if m]
    assert len(fault_at) == 1, [e[-2000:] for _, e, _ in res]
    for rank, (code, err, end) in enumerate(res):
        expected = faulty_code if rank == 1 else 4
        assert code == expected, (rank, code, err[-3000:])
        if code < 0:
            continue
        lines = _errors(err)
        assert len(lines) == 1 and "Traceback" not in err, (rank, err[-3000:])
        assert lines[0].startswith("shardwise train: error:") and line_for.get(rank, line_for.get(-1)) in lines[0], \
            (rank, lines[0])
        limit = TIMEOUT_S + SLACK_S + (STALL_S if rank == 1 else 0)
        assert end - fault_at[0] < limit, (rank, end - fault_at[0], limit)
    assert (out / "checkpoints" / "latest").read_text() == "global_step1"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["global_step1", "latest", "zero_to_fp32.py"]


def _diverged_line(kind: str, rank: str = r"\d") -> str:
    return f"{kind} failed on rank"


SP2 = {**DS, "train_batch_size": 2, "sequence_parallel_size": 2, "zero_optimization": {"stage": 2}}
EP2 = {**DS, "train_batch_size": 4, "zero_optimization": {"stage": 2},
       "expert_parallel": {"enabled": True, "autoep_size": 2}}
SP2_EP2 = {**DS, "train_batch_size": 4, "sequence_parallel_size": 2, "zero_optimization": {"stage": 2},
           "expert_parallel": {"enabled": True, "autoep_size": 2}}


@pytest.mark.parametrize("action", ["kill", "stall"])
def test_sp2_rank_fault_in_the_ulysses_exchange(tmp_path: Path, action: str) -> None:
    procs, out = _launch(tmp_path, 2, SP2, f"all_to_all:{action}", "llama-micro", {"FAULT_CALL": "2"})
    res = _finish(procs, out)
    _check(res, out, -9 if action == "kill" else 4, {-1: "all_to_all failed on rank"})


@pytest.mark.parametrize("action", ["kill", "stall"])
def test_ep2_rank_fault_in_the_expert_dispatch(tmp_path: Path, moe_folder: Path, action: str) -> None:
    procs, out = _launch(tmp_path, 2, EP2, f"all_to_all_v:{action}", str(moe_folder), {"FAULT_CALL": "3"})
    res = _finish(procs, out)
    _check(res, out, -9 if action == "kill" else 4, {-1: "all_to_all_ep failed on rank"})


@pytest.mark.parametrize("action", ["kill", "stall"])
def test_sp2_x_ep2_rank_fault_on_four_ranks(tmp_path: Path, moe_folder: Path, action: str) -> None:
    procs, out = _launch(tmp_path, 4, SP2_EP2, f"all_to_all_v:{action}", str(moe_folder), {"FAULT_CALL": "3"})
    res = _finish(procs, out)
    _check(res, out, -9 if action == "kill" else 4, {-1: "failed on rank"})


@pytest.mark.parametrize("phase, target, stage", [("forward", "forward", 2), ("backward", "backward", 2),
                                                  ("optimizer step", "step", 2),
                                                  # ZeRO-3's first gather after the save is the step's
                                                  ("optimizer step", "all_gather", 3)])
def test_a_rank_out_of_memory_names_itself_and_the_phase(tmp_path: Path, phase: str, target: str, stage: int):
    ds = {**DS, "train_batch_size": 4, "zero_optimization": {"stage": stage}}
    procs, out = _launch(tmp_path, 2, ds, f"{target}:oom", "llama-micro")
    res = _finish(procs, out)
    _check(res, out, 4, {1: f"rank 1 ran out of memory in the {phase} of step 2", 0: "failed on rank 0 of 2"})
