"""`shardwise train` run inside a rank pool's ranks (tests/rank_pool.py), as the CLI runs it.

``shardwise.cli.train.main`` is the CLI's own entry: given a world that is already up (the pool's),
it trains on that world and returns the exit code with the world still up and the run folder's
lock released, so the next case (a resume in the same folder) starts at once instead of paying for
a launcher, fresh interpreters and their torch/transformers imports. What is about the process
itself (exit codes through ``launch``, SIGTERM, kills) stays in the subprocess tests.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import torch.distributed as dist


def train(argv: list[str], check_lock: bool = True) -> tuple[int, str, str]:
    """Run ``shardwise train ARGV`` on this rank; returns (exit code, stdout, stderr) of this rank.

    The world must be the pool's after the run: a run that tore it down would fail every later case;
    and rank 0 must have let go of the run folder's lock (this process can take it again at once).
    ``check_lock=False`` skips that last check, for a run refused because another process holds
    the lock (taking it here would be refused too, rightly).
    """
    from pathlib import Path

    from shardwise.cli.train import main
    from shardwise.train.run_folder import RunLock

    out, err = io.StringIO(), io.StringIO()
    # catch_warnings resets Python's once-per-place memory: a warning an earlier case printed is
    # printed again, as a fresh process would (the filters themselves stay as they are)
    with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    assert dist.is_initialized(), "shardwise train destroyed a process group it did not make"
    if check_lock and dist.get_rank() == 0 and "--out" in argv:
        out_dir = Path(argv[len(argv) - argv[::-1].index("--out")])  # after the last --out, as argparse reads it
        if (out_dir / ".shardwise-lock").exists():
            RunLock(out_dir).acquire().release()  # refused ("in use by another run") if main() still held it
    return code, out.getvalue(), err.getvalue()


def train_from(folder: str, argv: list[str]) -> tuple[int, str, str]:
    """``train(argv)`` run from ``folder``, as a user runs a command from the checkout (relative
    paths in ARGV and in a run config); the pool puts the working directory back after the case."""
    import os

    os.chdir(folder)
    return train(argv)


def train_in(pool, argv: list[str], timeout: float = 600) -> str:
    """(In the test process.) ``shardwise train ARGV`` on every rank of ``pool``; asserts every rank
    exits 0 and returns every rank's output, rank 0's first, as a launch would print it."""
    answers = pool.run("train_cases:train", list(argv), timeout=timeout)
    log = "".join(stdout + stderr for _, stdout, stderr in answers)
    for rank, (code, _, _) in enumerate(answers):
        assert code == 0, f"rank {rank}: exit {code}\n{log[-4000:]}"
    return log
