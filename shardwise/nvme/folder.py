"""The swap folder of one rank: checked before training, locked for this run, removed at the end.

``<nvme_path>/shardwise-swap/rank<R>/`` holds the rank's swap files; ``rank<R>.lock`` beside it is
held with ``flock`` for the life of the run, so a second run on the same ``nvme_path`` is refused
(its rank 0 finds rank 0's lock taken) instead of both overwriting each other's files. A second engine of
the same process (DeepSpeed-Chat's actor and critic built from one config, a Trainer made again after a
first one, a hyperparameter search) is not another run: it takes the next free folder,
``rank<R>.1/``, ``rank<R>.2/``..., each locked and removed on its own, as DeepSpeed lets such engines share
a path. The lock dies
with the process, so a run killed by ``SIGKILL`` leaves its files but not its lock: the next run takes
the lock and removes them first. The files go at :meth:`SwapFolder.close`, which the engine's
teardown, ``atexit`` (a normal exit, an exception, Ctrl-C) and garbage collection all call.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import weakref
from pathlib import Path

from shardwise.errors import UserError
from shardwise.units import human_bytes


def check_room(key: str, path: Path, need: int, local_ranks: int = 1) -> None:
    """``path`` exists, is a writable folder, and its filesystem has room for ``local_ranks`` ranks' swap
    files of ``need`` bytes each, or one line naming ``key``, the path and the bytes.

    The ranks of one node share the disk and check it one after another, each while the others may already
    be writing: so the room is the free bytes plus those that live runs' swap folders under ``path`` hold
    already (:func:`swap_usage`), the same for every rank whenever it looks, and the need counts, for each
    of the node's ranks, ``need`` and what this process's other swap folders there hold (the parameters'
    files, when the optimizer's check comes after them)."""
    if not path.exists():
        tilde = " (a leading '~' is not expanded: write the full path)" if str(path).startswith("~") else ""
        raise UserError(f"{key}: {path} does not exist{tilde}; create it (a folder on the NVMe disk) or fix the path")
    if not path.is_dir():
        raise UserError(f"{key}: {path} is not a folder")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{key}: {path} is not writable by this user")
    if need <= 0:
        return
    mine, held = swap_usage(path)
    free = shutil.disk_usage(path).free  # read after the folders: a write in between only lowers the room
    total = local_ranks * (need + mine)
    if free + held < total:
        ranks = f" for {local_ranks} ranks of this node" if local_ranks > 1 else ""
        held_note = f" (+ {human_bytes(held)} in this run's swap files)" if held else ""
        raise UserError(f"{key}: {path} has {human_bytes(free)} ({free} bytes) free{held_note}, the swap files"
                        f"{ranks} need {human_bytes(total)} ({total} bytes); free space or choose another disk")


def swap_usage(path: Path) -> tuple[int, int]:
    """(bytes in this process's swap folders under ``path``, bytes in every live run's): a folder is live
    while the process whose id its lock file holds runs (a killed run's folder is not: its rank's next
    start removes it)."""
    mine = held = 0
    base = Path(path) / "shardwise-swap"
    for lock in base.glob("*.lock") if base.is_dir() else ():
        pid = _holder(lock)
        if pid is None:
            continue
        folder = lock.with_suffix("")
        nbytes = sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) if folder.is_dir() else 0
        held += nbytes
        mine += nbytes if pid == os.getpid() else 0
    return mine, held


def _holder(lock: Path) -> int | None:
    """The id of the live process that wrote ``lock``, else None (dead, unreadable, or not yet written)."""
    try:
        pid = int(lock.read_text().split()[0])
        os.kill(pid, 0)
    except PermissionError:
        return pid  # alive, another user's
    except (OSError, ValueError, IndexError):
        return None
    return pid


def _remove(folder: Path, lock_fd: list[int]) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    if lock_fd:
        fd = lock_fd.pop()
        (folder.parent / f"{folder.name}.lock").unlink(missing_ok=True)
        os.close(fd)
    try:
        folder.parent.rmdir()  # the last rank out removes shardwise-swap/ too
    except OSError:
        pass


def _take_lock(key: str, root: Path, lock: Path) -> int | None:
    """``lock`` opened and flocked; retried when the file we locked is no longer the one at the path (its
    holder unlinked it on exit between our open and our flock: a third run would lock a new file). None when
    this process holds it (another engine of this run: the caller takes the next folder)."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if _holder(lock) == os.getpid():
                return None
            raise UserError(f"{key}: {root} is in use by another run (the lock {lock} is held); give each "
                            "run its own nvme_path") from None
        held = os.fstat(fd)
        try:
            now = os.stat(lock)
            if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _sweep_stale(base: Path, name: str) -> None:
    """Killed runs' ``<name>.<n>/`` folders (a second engine's) whose lock nobody holds: removed, as the
    first folder is when its next run starts. A lock held (by an engine of this process or of a live run)
    is left alone: ``flock`` refuses a second open file even in the holder's process."""
    for folder in base.glob(f"{name}.*"):
        if not (folder.is_dir() and folder.name[len(name) + 1:].isdigit()):
            continue
        lock = folder.with_name(folder.name + ".lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        shutil.rmtree(folder, ignore_errors=True)
        lock.unlink(missing_ok=True)
        os.close(fd)


class SwapFolder:
    """This rank's swap folder under ``nvme_path``, locked; ``key`` names the config key in messages."""

    def __init__(self, key: str, nvme_path: str | os.PathLike, rank: int, kind: str = ""):
        """``kind``: a prefix of the rank's folder and lock (``param-``: parameters' files beside the optimizer's)."""
        root = Path(nvme_path)
        check_room(key, root, 0)
        base = root / "shardwise-swap"
        base.mkdir(exist_ok=True)
        fd, n = None, 0
        while fd is None:  # this process's other engines hold rank<R>, rank<R>.1, ...: the next free one
            self.path = base / (f"{kind}rank{rank}" + (f".{n}" if n else ""))
            fd = _take_lock(key, root, self.path.with_name(self.path.name + ".lock"))
            n += 1
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            if self.path.exists():  # a killed run's files (its lock died with it)
                shutil.rmtree(self.path)
            self.path.mkdir()
            if n == 1:  # the rank's first folder: a killed run's second engines' folders go too
                _sweep_stale(base, self.path.name)
        except OSError as e:  # the lock released with the error, not held until the process ends
            os.close(fd)
            raise UserError(f"{key}: cannot replace {self.path} (a killed run's swap folder?): {e.strerror}") from None
        self._lock_fd = [fd]
        self._finalizer = weakref.finalize(self, _remove, self.path, self._lock_fd)
        atexit.register(self._finalizer)

    def file(self, name: str) -> Path:
        return self.path / name

    def close(self) -> None:
        """Remove the swap files and release the lock (idempotent)."""
        self._finalizer()
