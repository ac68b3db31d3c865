"""One writer per run folder, and which checkpoints a run keeps.

**Lock.** The run that writes ``--out`` holds an exclusive ``flock`` on ``OUT/.shardwise-lock`` from
before its first write until it returns (``train.run.main`` releases it) or its process ends. The
kernel drops the lock when the process ends in any way (exit, exception, SIGKILL, OOM kill), so a
crashed run never leaves the folder stuck and there is no stale-lock cleanup to get wrong; a
second run on the folder is refused in one line. Only global
rank 0 locks: it is the process that writes the run's files (metrics, plot, export, ``latest``),
and the other ranks learn its answer before they write anything (see ``train.run``).

**Retention.** ``--keep N`` keeps the N checkpoints written last (write order: the time each
checkpoint folder was completed), and never deletes the one ``latest`` names. Step numbers are
not write order: after ``latest`` is pointed at an earlier step and the run resumed, the old run's
higher steps are older saves than the new ones.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import socket
import stat
from pathlib import Path

from shardwise.errors import UserError

LOCK_NAME = ".shardwise-lock"
TAG = re.compile(r"global_step(\d+)")


class RunLock:
    """An exclusive, non-blocking ``flock`` on ``run_dir/.shardwise-lock``, held until :meth:`release`
    or the end of the process. The file records the holder (pid and host) for the error message."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as e:
            raise UserError(f"--out {self.run_dir}: cannot open its lock file {self.path} ({e.strerror}); "
                            "remove it if it is not a plain file") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UserError(f"--out {self.run_dir}: its lock file {self.path} is not a plain file; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UserError(f"--out {self.run_dir} is in use by another run (holder: {holder}); wait for it "
                            "to end, or choose another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        """Unlock (the file stays: deleting it would let a waiting run lock a file nobody sees)."""
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor of the open file drops the flock
            self.fd = None


def step_of(tag: Path) -> int:
    """N for a ``global_stepN`` folder name, else -1."""
    m = TAG.fullmatch(tag.name)
    return int(m.group(1)) if m else -1


def prune_checkpoints(ckpt_dir: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` checkpoints written last, never the one ``latest`` names;
    returns the deleted folders. ``keep`` 0 keeps everything."""
    if keep <= 0:
        return []
    latest = ckpt_dir / "latest"
    named = latest.read_text().strip() if latest.is_file() else None
    tags = [p for p in ckpt_dir.iterdir() if p.is_dir() and not p.is_symlink() and step_of(p) >= 0]
    by_write = sorted(tags, key=lambda p: (p.stat().st_mtime_ns, step_of(p)))
    others = [p.name for p in by_write if p.name != named]
    if named in {p.name for p in tags}:  # what latest names, then the newest others
        kept = {named, *others[len(others) - (keep - 1):]}
    else:
        kept = set(others[len(others) - keep:])
    gone = [p for p in tags if p.name not in kept]
    for old in gone:
        shutil.rmtree(old, ignore_errors=True)
    return gone
