"""A rank forked by ``fresh_ranks.start`` starts and ends as ``python -c`` would (issue 48): the same
signal handlers, signal mask, faulthandler state, threads, torch thread count, environment and
argv; its fd-level stdout/stderr captured (a faulthandler dump included); the same exit code for a
return, an uncaught exception (traceback, ``sys.last_value`` set when the atexit handlers run) and
SIGKILL (-9, as ``Popen`` reports it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fresh_ranks  # noqa: E402

pytestmark = pytest.mark.subprocess  # a fresh interpreter and forked ranks are the subject
CASES = ["3", "raise", "kill"]


def _env() -> dict[str, str]:
    return {**os.environ, "RANK": "1", "OMP_NUM_THREADS": "1", "PROBE": "yes",
            "PYTHONPATH": str(fresh_ranks.HERE.parent)}


def _fresh(arg: str) -> tuple[int, str, str]:
    code = f"import sys; sys.path.insert(0, {str(fresh_ranks.HERE)!r}); import fresh_ranks; " \
           "sys.exit(fresh_ranks.probe(sys.argv[1:]))"
    p = subprocess.run([sys.executable, "-c", code, arg], env=_env(), capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


def test_a_forked_rank_starts_and_ends_as_a_fresh_interpreter(tmp_path: Path) -> None:
    ranks = {arg: fresh_ranks.start("fresh_ranks:probe", [arg], _env(), tmp_path / arg) for arg in CASES}
    forked = {arg: (r.wait(120), *r.communicate()) for arg, r in ranks.items()}
    assert fresh_ranks.server_threads() == 1  # it forks with no thread another could need
    for arg in CASES:
        fresh = _fresh(arg)
        for (code, out, err), how in ((fresh, "fresh"), (forked[arg], "forked")):
            assert code == {"3": 3, "raise": 1, "kill": -9}[arg], (how, code, err)
            state = json.loads(out.splitlines()[0])
            assert state["env"] == {"RANK": "1", "OMP_NUM_THREADS": "1", "PROBE": "yes"}, (how, state)
            assert state["argv"] == [arg] and state["threads"] == 1 and state["torch_threads"] == 1, (how, state)
            assert "Stack (most recent call first)" in err and "in probe" in err, (how, err)
            if arg == "raise":
                assert "RuntimeError: probe raised" in err and "atexit: last_value=RuntimeError" in err, (how, err)
            elif arg == "3":
                assert "atexit: last_value=NoneType" in err, (how, err)
            else:
                assert "atexit" not in err, (how, err)
        assert json.loads(fresh[1].splitlines()[0]) == json.loads(forked[arg][1].splitlines()[0]), arg
