"""Tests write under their tmp folders, never into the checkout (loaded by tests/conftest.py).

A test that ran ``shardwise train`` without ``--out`` from the repository root once left
``runs/default`` there: gitignored, so no ``git status`` showed it, and the next user's
``shardwise train`` in that checkout found a run folder it had not made. This plugin lists what
is not tracked in the checkout (ignored paths included) when the session starts and again when it
ends, and fails the run naming every path that appeared; after each test it compares the top-level
names (one ``listdir``) so the message can also name the first test that made each of them.
Caches that tools keep on purpose are left out: Python's bytecode, pytest's and ruff's caches,
hypothesis' example database, the editable install's metadata.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL_CACHES = {"__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", ".venv"}

_before: dict[str, set[str]] = {}  # "untracked": paths at session start; "top": top-level names now
_made_by: dict[str, str] = {}  # new top-level name -> the test after which it was first seen


def _kept(path: str) -> bool:
    parts = Path(path).parts
    return not any(p in TOOL_CACHES or p.endswith(".egg-info") for p in parts)


def untracked() -> set[str] | None:
    """Every path git does not track here (ignored ones too, folders as one entry); None outside a
    git checkout (an unpacked archive), where there is nothing to compare."""
    try:  # --others without --exclude-standard: the ignored paths as well
        out = subprocess.run(["git", "ls-files", "--others", "--directory", "--no-empty-directory", "-z"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return None if out.returncode else {p for p in out.stdout.split("\0") if p and _kept(p)}


def pytest_sessionstart(session) -> None:  # noqa: ARG001
    found = untracked()
    if found is not None:
        _before["untracked"] = found
    _before["top"] = set(os.listdir(ROOT))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001
    yield
    if "top" not in _before:
        return
    now = set(os.listdir(ROOT))
    for name in now - _before["top"]:
        _made_by.setdefault(name, item.nodeid)
    _before["top"] = now | _before["top"]


def new_paths() -> list[str]:
    """Paths that were not in the checkout when the session started, with the test that made them
    where the per-test listing saw it."""
    if "untracked" not in _before:
        return []
    after = untracked() or set()
    return [f"{p} (first seen after {_made_by[Path(p).parts[0]]})" if Path(p).parts[0] in _made_by else p
            for p in sorted(after - _before["untracked"])]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:  # noqa: ARG001
    made = new_paths()
    if not made:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", "tests wrote into the checkout, not their tmp folder (tests/tree_guard.py)", red=True)
        for line in made:
            reporter.write_line(line, red=True)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
