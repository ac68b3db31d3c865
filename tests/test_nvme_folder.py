"""The swap folder: nvme_path checked before training (missing, not writable, no room), one run per
path (the lock), files removed at close, at exit, on Ctrl-C, and a killed run's files on the next start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest

from shardwise.errors import UserError
from shardwise.nvme import SwapFolder, check_room

KEY = "zero_optimization.offload_optimizer.nvme_path"


def test_missing_path_and_a_file_are_refused_naming_key_and_path(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=f"^{KEY}: {tmp_path}/nope does not exist"):
        check_room(KEY, tmp_path / "nope", 1)
    with pytest.raises(UserError, match=r"~/nope does not exist \(a leading '~' is not expanded"):
        check_room(KEY, Path("~/nope"), 1)  # as a JSON config writes it; DeepSpeed would not expand it either
    (tmp_path / "f").write_text("")
    with pytest.raises(UserError, match=f"{tmp_path}/f is not a folder"):
        check_room(KEY, tmp_path / "f", 1)


def test_not_writable_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(os, "access", lambda *_a, **_k: False)  # root may write anywhere: the check, faked
    with pytest.raises(UserError, match=f"{KEY}: {tmp_path} is not writable"):
        check_room(KEY, tmp_path, 1)


def test_no_room_names_the_bytes(tmp_path: Path, monkeypatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda _p: usage(10 << 30, 10 << 30, 1000))
    with pytest.raises(UserError, match=r"has 1000 B \(1000 bytes\) free, the swap files need 1\.00 MiB "
                                        r"\(1048576 bytes\)"):
        check_room(KEY, tmp_path, 1 << 20)


_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.subprocess
def test_the_lock_refuses_a_second_run_and_close_removes_everything(tmp_path: Path) -> None:
    first = SwapFolder(KEY, tmp_path, rank=0)
    first.file("a.swap").write_bytes(b"x")
    # another engine of this process (DeepSpeed-Chat's actor and critic, a Trainer made again): its own folder
    second = SwapFolder(KEY, tmp_path, rank=0)
    assert second.path.name == "rank0.1" and list(second.path.iterdir()) == []
    other_rank = SwapFolder(KEY, tmp_path, rank=1)  # the ranks of one run share the path
    first.close()
    first.close()  # idempotent
    second.close()
    assert sorted(os.listdir(tmp_path / "shardwise-swap")) == ["rank1", "rank1.lock"]
    other_rank.close()
    assert os.listdir(tmp_path) == []
    # another process (a second run) holding rank 0's lock: refused
    (tmp_path / "shardwise-swap").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path / "shardwise-swap" / "rank0.lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(UserError, match=f"{KEY}: {tmp_path} is in use by another run"):
            SwapFolder(KEY, tmp_path, rank=0)
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_runs_files_go_at_the_next_start(tmp_path: Path) -> None:
    """Its second engine's folder too (``rank0.1``), but not one this process's other engine holds."""
    for name in ("rank0", "rank0.1", "rank0.2"):
        stale = tmp_path / "shardwise-swap" / name
        stale.mkdir(parents=True)
        (stale / "group00000.swap").write_bytes(b"old")
    (tmp_path / "shardwise-swap" / "rank0.2.lock").write_text("999999999\n")
    held = SwapFolder(KEY, tmp_path, rank=0)  # takes rank0, sweeps rank0.1 and rank0.2
    assert sorted(os.listdir(tmp_path / "shardwise-swap")) == ["rank0", "rank0.lock"]
    assert list(held.path.iterdir()) == []
    held.close()
    live = [SwapFolder(KEY, tmp_path, rank=0), SwapFolder(KEY, tmp_path, rank=0)]  # rank0, rank0.1
    live[0].close()
    again = SwapFolder(KEY, tmp_path, rank=0)  # rank0 again: rank0.1 is held, left alone
    assert live[1].path.is_dir() and again.path.name == "rank0"
    again.close()
    live[1].close()
    assert os.listdir(tmp_path) == []


_CHILD = """
import sys, time
from shardwise.nvme import SwapFolder
f = SwapFolder("k", sys.argv[1], rank=0)
f.file("g.swap").write_bytes(b"x" * 4096)
print("ready", flush=True)
if sys.argv[2] == "raise":
    raise RuntimeError("a failure")
time.sleep(60)
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("how", ["ctrl-c", "raise"])
def test_files_removed_on_ctrl_c_and_after_a_failure(tmp_path: Path, how: str) -> None:
    """The process is the subject: a Ctrl-C (SIGINT) while it waits, or an exception, leaves no file."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path), how], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        if how == "ctrl-c":
            time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and ("KeyboardInterrupt" in err or "a failure" in err)
    assert os.listdir(tmp_path) == []
