"""A user's training script run inside a rank pool's ranks (tests/rank_pool.py), as ``python
script.py ARGS`` runs under a launcher (issue 48).

The DeepSpeed-style example scripts call ``deepspeed.initialize`` / ``init_distributed``, which
find the pool's world already up (RANK, WORLD_SIZE, LOCAL_RANK and MASTER_* set, as a launcher sets
them) and use it; the script runs as ``__main__`` with its own ``sys.argv``, and what it prints is
returned. What is about the launch itself (the launcher's processes, their exit codes, an abort at
exit) stays in the subprocess tests: tests/test_launch_exit.py launches ``checkpoint_resume.py``
for real, four times.
"""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
import warnings

import torch.distributed as dist


def run_script(path: str, argv: list[str]) -> str:
    """Run ``path`` as ``__main__`` with ``argv`` on this rank; return what it printed on stdout.
    The world must still be the pool's afterwards (a script that tore it down would fail every later
    case); a non-zero ``sys.exit`` fails the case."""
    out, saved_argv = io.StringIO(), sys.argv
    sys.argv = [path, *argv]
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise AssertionError(f"{path} exited {exc.code}:\n{out.getvalue()[-3000:]}") from exc
    finally:
        sys.argv = saved_argv
    assert dist.is_initialized(), f"{path} destroyed a process group it did not make"
    return out.getvalue()


def run_in(pool, path: str, argv: list[str], timeout: float = 600) -> str:
    """(In the test process.) ``path`` on every rank of ``pool``; every rank's output, rank 0's first,
    as a launch prints it."""
    return "".join(pool.run("script_cases:run_script", path, list(argv), timeout=timeout))
