"""`shardwise train` and `shardwise launch` against runs that lose checkpoints, run twice, diverge or
cannot start (issue 34), tiny models, one test per class: the real CLI in subprocesses where the
process is the subject (exit codes, one-line errors, a kill), else the CLI's entry in the rank pools.
A single-process ``shardwise train`` is forked from a server that has imported torch, transformers
and shardwise (``fresh_ranks.py``: the CLI's entry, its own environment, argv, output files and exit
code as the OS sees it); the launcher, which imports no torch, is started as a program.

- retention keeps the saves written last and never the one ``latest`` names (a resume into a
  folder whose older run went further);
- a run folder has one writer: a second run (2 ranks) is refused in one line while the first runs,
  and a SIGKILLed holder leaves nothing stuck;
- non-finite values stop the run at the step they appear (exit 3, one line), nothing non-finite is
  saved or exported, ``--max-nonfinite-steps`` skips that many, fp16 loss-scale skips do not count;
- launcher and environment failures are one line: a rank file missing on resume (2 ranks, exit 2),
  the master port in use (launcher and single process, exit 2), a script rank that crashes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import fresh_ranks
import pytest
import torch
from rank_pool import RankPool

from shardwise.train.divergence import DivergedError, FiniteLogits
from shardwise.train.outputs import read_metrics
from shardwise.train.run_folder import RunLock

ROOT = Path(__file__).resolve().parent.parent
DS = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def _train_args(tmp: Path, out: Path, *extra: str, ds: dict | None = None) -> list[str]:
    cfg = tmp / f"ds_{out.name}_{len(list(tmp.glob('ds_*')))}.json"
    cfg.write_text(json.dumps(ds or DS))
    return ["--config", str(cfg), "--model", "llama-micro", "--seq", "32", "--eval-every", "0",
            "--sample-tokens", "0", "--out", str(out), *extra]


def _train_in(pool: RankPool, tmp: Path, out: Path, *extra: str) -> None:
    """The same run on the pool's ranks through the CLI's entry (tests/train_cases.py): for the
    tests about the run folder, not about the process."""
    answers = pool.run("train_cases:train", _train_args(tmp, out, *extra), timeout=400)
    assert all(code == 0 for code, _, _ in answers), "".join(o + e for _, o, e in answers)[-3000:]


def _in_pool(pool: RankPool, tmp: Path, out: Path, *extra: str, ds: dict | None = None,
             check_lock: bool = True) -> subprocess.CompletedProcess:
    """``shardwise train`` on the pool's ranks through the CLI's entry, read as a launch's output:
    the exit code every rank returned (they must agree), every rank's stdout and stderr, rank 0's
    first. For the tests whose subject is what a run writes or refuses, not the process."""
    argv = _train_args(tmp, out, *extra, ds=ds)
    answers = pool.run("train_cases:train", argv, check_lock, timeout=400)
    codes = {code for code, _, _ in answers}
    log = "".join(o + e for _, o, e in answers)
    assert len(codes) == 1, (codes, log[-3000:])
    return subprocess.CompletedProcess(argv, codes.pop(), "".join(o for _, o, _ in answers),
                                       "".join(e for _, _, e in answers))


def _forked_train(tmp: Path, out: Path, *extra: str, ds: dict | None = None, **env: str) -> fresh_ranks.Rank:
    """``python -m shardwise.cli train ...`` as a process forked from the suite's forkserver (CLI imports done)."""
    argv = ["train", *_train_args(tmp, out, *extra, ds=ds)]
    return fresh_ranks.start("shardwise.cli.command:main", argv, _env(**env), tmp / f"proc_{out.name}")


def _ended(rank: fresh_ranks.Rank, timeout: float = 400) -> subprocess.CompletedProcess:
    """The forked run's exit code and output, read as ``subprocess.run``'s (killed after ``timeout``)."""
    if rank.wait(timeout) is None:
        rank.kill()
    stdout, stderr = rank.communicate()
    return subprocess.CompletedProcess(["shardwise", "train"], rank.returncode, stdout, stderr)


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=_env(**env), capture_output=True, text=True, timeout=400)


def _error_lines(r: subprocess.CompletedProcess) -> list[str]:
    """stderr without the progress bar's redraws and the log's warnings: what a user reads as the error."""
    return [ln for ln in r.stderr.splitlines()
            if ln.strip() and "step/s" not in ln and "?step" not in ln and not ln.startswith("[shardwise")]


def _one_line(r: subprocess.CompletedProcess, code: int, *words: str) -> str:
    lines = _error_lines(r)
    assert r.returncode == code, (r.returncode, r.stderr[-3000:])
    assert len(lines) == 1 and "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr, r.stderr[-3000:]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory, pool2: RankPool) -> tuple[Path, Path]:
    """A 2-rank run of 4 steps saving every step, all checkpoints kept: (tmp folder, run folder)."""
    tmp = tmp_path_factory.mktemp("guard")
    out = tmp / "run"
    _train_in(pool2, tmp, out, "--steps", "4", "--save-every", "1", "--keep", "0", "--no-export")
    return tmp, out


def test_keep_holds_the_newest_saves_and_latest_after_resuming_an_earlier_step(two_rank_run,
                                                                                  pool1: RankPool) -> None:
    """The issue's case: `latest` set back to step 2 of a run that went to 4, resumed with --keep 1.
    Keeping the highest step numbers deleted the new global_step3 that `latest` named."""
    tmp, first = two_rank_run
    out = tmp / "rewound"
    shutil.copytree(first, out, symlinks=True)
    (out / "checkpoints" / "latest").write_text("global_step2")
    _train_in(pool1, tmp, out, "--steps", "3", "--save-every", "1", "--keep", "1", "--no-export", "--resume", "auto")
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["global_step3", "latest", "zero_to_fp32.py"]
    assert (ckpts / "latest").read_text().strip() == "global_step3"
    assert [m["step"] for m in read_metrics(out) if m["kind"] == "train"] == [1, 2, 3]


def test_rank_file_missing_on_resume_is_one_line_exit_2(two_rank_run, pool2: RankPool) -> None:
    """The refusal itself (code 2 on both ranks, one line naming the file); the launcher's exit code
    and its one line for a rank's refusal are the launch tests' subject."""
    tmp, first = two_rank_run
    out = tmp / "damaged"
    shutil.copytree(first, out, symlinks=True)
    (out / "checkpoints" / "global_step4" / "rank00001.safetensors").unlink()
    r = _in_pool(pool2, tmp, out, "--steps", "5", "--no-export", "--resume", "auto")
    _one_line(r, 2, "rank00001.safetensors", "missing")


@pytest.mark.subprocess
def test_second_writer_is_refused_and_a_killed_holder_leaves_no_lock(tmp_path: Path, pool2: RankPool) -> None:
    """The holder is a process of its own (the lock is held across processes, then SIGKILLed); the
    refused second writer runs on the pool's 2 ranks, processes other than the holder's."""
    out = tmp_path / "shared"
    first = _forked_train(tmp_path, out, "--steps", "100000", "--save-every", "0", "--no-export")
    try:
        deadline = time.time() + 240
        while time.time() < deadline and first.poll() is None and not read_metrics(out):
            time.sleep(0.2)  # a metrics line: the first run holds the lock and trains
        assert first.poll() is None, first.err.read_text()[-3000:]
        config_before = (out / "run_config.json").read_text()
        second = _in_pool(pool2, tmp_path, out, "--steps", "5", "--resume", "auto", check_lock=False)
        _one_line(second, 2, f"--out {out} is in use by another run", f"pid {first.pid}")
        assert (out / "run_config.json").read_text() == config_before  # the refused run wrote nothing
        first.kill()  # SIGKILL: no exit handler runs, only the kernel can drop the lock
        assert first.wait(timeout=60) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert (out / ".shardwise-lock").read_text().startswith(f"pid {first.pid} ")  # the dead holder's file
    RunLock(out).acquire().release()  # is no obstacle: the kernel dropped the lock with the process


@pytest.mark.subprocess
def test_non_finite_values_stop_the_run_at_their_step(tmp_path: Path, pool1: RankPool) -> None:
    """lr 1e36: step 1 is finite and blows the weights up, step 2's gradient norm is NaN.

    That run is a process of its own (exit 3 as the OS sees it, the CLI's one line); the other five,
    about where and why a run stops and what it leaves, run one after another on the world-1 pool
    while it trains."""
    big = {**DS, "optimizer": {"type": "AdamW", "params": {"lr": 1e36}}}
    overflow = {**DS, "fp16": {"enabled": True, "initial_scale_power": 0},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e6}}}
    typo = {**DS, "optimizer": {"type": "AdamW", "params": {"lr": 1e6}}}  # issue 46: 1e6 for 1e-6
    nan, tolerated, last, skips, evals, no_eval = (tmp_path / n for n in (
        "nan", "tolerated", "last_step", "scaler_skips", "eval_nan", "no_eval"))
    proc = _forked_train(tmp_path, nan, "--steps", "4", "--save-every", "1", "--keep", "0", ds=big)
    try:
        # one skipped (no update), the next stops; set by the config key (the flag overrides it)
        r_tol = _in_pool(pool1, tmp_path, tolerated, "--steps", "4", "--save-every", "1",
                         ds={**big, "shardwise": {"max_nonfinite_steps": 1}})
        # finite loss and gradients at the last step, but the weights leave fp16's range
        r_last = _in_pool(pool1, tmp_path, last, "--steps", "1", ds=overflow)
        # overflow skips of fp16's loss scaler (2**24 overflows at first) are not divergence
        r_skips = _in_pool(pool1, tmp_path, skips, "--steps", "3",
                           ds={**DS, "fp16": {"enabled": True, "initial_scale_power": 24}})
        # loss and gradient norm finite (step 2's norm exactly 0.0), the final eval loss NaN
        r_eval = _in_pool(pool1, tmp_path, evals, "--steps", "2", "--save-every", "1", ds=typo)
        # the same with no eval data: the probe forward before the checkpoint finds it
        r_no_eval = _in_pool(pool1, tmp_path, no_eval, "--steps", "2", "--save-every", "1", "--eval-fraction", "0",
                             ds=typo)
        r_nan = _ended(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _one_line(r_nan, 3, "diverged at step 2:", "gradient norm nan", "checkpoints/global_step1")
    assert (nan / "checkpoints" / "latest").read_text() == "global_step1" and not (nan / "hf").exists()
    assert sorted(p.name for p in (nan / "checkpoints").iterdir()) == ["global_step1", "latest", "zero_to_fp32.py"]
    rows = read_metrics(nan)
    assert [m["step"] for m in rows] == [1, 2] and math.isnan(rows[1]["grad_norm"]) and "nonfinite" in rows[1]
    assert '"grad_norm": NaN' in (nan / "metrics.jsonl").read_text().splitlines()[1]

    _one_line(r_tol, 3, "diverged at step 3:", "1 non-finite step(s) skipped before", "global_step2")

    _one_line(r_last, 3, "diverged at step 1:", "weights", "float16")
    assert not (last / "checkpoints").exists() and not (last / "hf").exists()

    assert r_skips.returncode == 0, r_skips.stderr[-3000:]
    rows = read_metrics(skips)
    assert not math.isfinite(rows[0]["grad_norm"]) and not any("nonfinite" in m for m in rows)
    assert (skips / "hf" / "config.json").is_file()

    _one_line(r_eval, 3, "diverged at step 2:", "eval loss nan", "checkpoints/global_step1")
    assert (evals / "checkpoints" / "latest").read_text() == "global_step1" and not (evals / "hf").exists()
    assert not (evals / "checkpoints" / "global_step2").exists()
    assert r_eval.stdout.count("gradient norm is exactly 0.0") == 1 and "warning: at step 2" in r_eval.stdout
    rows = read_metrics(evals)
    assert rows[-1]["kind"] == "eval" and math.isnan(rows[-1]["eval_loss"]) and rows[1]["grad_norm"] == 0.0
    _one_line(r_no_eval, 3, "diverged at step 2:", "loss on a training sequence is nan")
    assert (no_eval / "checkpoints" / "latest").read_text() == "global_step1" and not (no_eval / "hf").exists()


def test_sampled_non_finite_logits_stop_sampling() -> None:
    """NaN, +inf, or a row with nothing finite stops generate(); -inf alone is a masked token."""
    guard = FiniteLogits(step=5)
    ids = torch.zeros(1, 3, dtype=torch.long)
    ok = torch.tensor([[0.0, -math.inf, 2.0]])
    assert guard(ids, ok) is ok
    for bad in ([[0.0, math.nan, 1.0]], [[0.0, math.inf, 1.0]], [[-math.inf, -math.inf, -math.inf]]):
        with pytest.raises(DivergedError, match="diverged at step 5: the sampled logits are not finite"):
            guard(ids, torch.tensor(bad))


@pytest.mark.subprocess
def test_port_in_use_and_crashed_rank_are_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        script = tmp_path / "ok.py"
        script.write_text("print('ran')\n")
        r = _run([sys.executable, "-m", "shardwise.cli", "launch", "--nproc", "2", "--master-port", port,
                  str(script)])
        _one_line(r, 2, f"--master-port {port}", f"port {port} is already in use")
        r = _ended(_forked_train(tmp_path, tmp_path / "single", "--steps", "1", MASTER_PORT=port))
        _one_line(r, 2, f"MASTER_PORT={port}", "already in use")
        # a child of a running rank (torchrun'd script, notebook) inherits its rendezvous: told what to unset
        r = _ended(_forked_train(tmp_path, tmp_path / "child", "--steps", "1", MASTER_PORT=port, RANK="0",
                                 WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1"))
        _one_line(r, 2, f"MASTER_PORT={port}: port {port} is already in use", "RANK=0 and MASTER_PORT came from the "
                  "environment", "unset RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT", "shardwise launch")
    crash = tmp_path / "crash.py"
    crash.write_text("import os\nif os.environ['RANK'] == '1':\n    raise SystemExit('rank 1 cannot start')\n"
                     "import time\ntime.sleep(30)\n")
    r = _run([sys.executable, "-m", "shardwise.cli", "launch", "--nproc", "2", str(crash)])
    lines = _error_lines(r)
    assert r.returncode == 1 and "ChildFailedError" not in r.stderr and len(lines) == 2, r.stderr[-3000:]
    assert lines[0] == "rank 1 cannot start" and lines[1].startswith("shardwise launch: error: rank 1 (local rank 1")
    assert lines[1].endswith("exited with code 1; its output is above"), lines[1]


def test_every_run_config_option_has_a_type() -> None:
    """Each option's own default passes; a list never does; a float or a bool is no whole number."""
    from shardwise.cli.train_options import build_parser, type_error

    actions = [a for a in build_parser()._actions if a.dest not in ("help", "run_config")]
    for act in actions:
        assert type_error(act, act.default) is None, act.dest
        assert type_error(act, [1]) is not None, act.dest
        if act.type is int:
            assert type_error(act, 2.5) and type_error(act, True) and type_error(act, "3"), act.dest
    assert {a.dest for a in actions if a.type is int} >= {"steps", "seq", "keep", "max_nonfinite_steps"}


@pytest.mark.parametrize("stage", [1, 3])
def test_engine_stops_or_skips_a_non_finite_gradient_norm(pool2, stage: int) -> None:
    """shardwise.initialize's rule, on both ranks alike though only rank 1's loss is NaN."""
    for r in pool2.run("nonfinite_cases:skip_then_raise", stage, 0):
        assert r["seen"] == [{"applied": True, "weights_unchanged": False},
                             {"raised_at": 2, "what": "gradient norm"}], r
    for r in pool2.run("nonfinite_cases:skip_then_raise", stage, 1):
        assert r["seen"] == [{"applied": True, "weights_unchanged": False},
                             {"applied": False, "weights_unchanged": True},
                             {"raised_at": 3, "what": "gradient norm"}], r
        assert r["skipped"] == 1 and r["nonfinite"] == 2
