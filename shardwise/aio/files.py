"""Files opened for direct I/O where their filesystem takes it, buffered (and said so) where not.

``O_DIRECT`` keeps the bytes out of the page cache: a tensor written to disk is on the disk, not in
host memory under another name, which is the point of NVMe offload. Some filesystems refuse the flag
(tmpfs before Linux 6.6, some FUSE and network mounts: ``open`` fails with ``EINVAL``); there the file is opened
without it and a warning is logged once per folder. A buffered write is then followed by
``fdatasync`` and ``POSIX_FADV_DONTNEED``, so the kernel may drop the cached pages at once (on tmpfs
the pages *are* the storage: the bytes stay in RAM, which is what tmpfs means).
"""

from __future__ import annotations

import errno
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("shardwise")

_WARNED: set[str] = set()


class AioError(OSError):
    """A read or write of the I/O engine failed (or came back short): the message names the file,
    the offset and the byte count."""


@dataclass
class AioFile:
    """An open file: ``direct`` says whether transfers bypass the page cache (``O_DIRECT``)."""

    path: Path
    fd: int
    direct: bool

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def truncate(self, nbytes: int) -> None:
        with self.named("truncate"):
            os.ftruncate(self.fd, nbytes)

    def sync(self) -> None:
        with self.named("fsync"):
            os.fsync(self.fd)

    @contextmanager
    def named(self, what: str):
        """An OSError of the body as an :class:`AioError` naming the file (a write's EIO or ENOSPC often
        surfaces only at the sync)."""
        try:
            yield
        except OSError as e:
            if isinstance(e, AioError):
                raise
            raise AioError(f"{self.path}: {what} failed: {e.strerror}") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_file(path: str | os.PathLike, write: bool = True, direct: bool = True) -> AioFile:
    """Open ``path`` (created when ``write``) with ``O_DIRECT`` when ``direct`` and the filesystem allows
    it; else buffered, with a warning logged once for the folder."""
    path = Path(path)
    flags = (os.O_RDWR | os.O_CREAT if write else os.O_RDONLY) | getattr(os, "O_CLOEXEC", 0)
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return AioFile(path, os.open(path, flags | os.O_DIRECT, 0o600), True)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise AioError(f"{path}: cannot open: {e.strerror}") from None
            folder = str(path.parent)
            if folder not in _WARNED:
                _WARNED.add(folder)
                log.warning("shardwise.aio: %s does not take O_DIRECT (tmpfs or a similar filesystem): its "
                            "files are read and written through the page cache (docs/offload.md)", folder)
    try:
        return AioFile(path, os.open(path, flags, 0o600), False)
    except OSError as e:
        raise AioError(f"{path}: cannot open: {e.strerror}") from None


def takes_direct_io(folder: str | os.PathLike) -> bool:
    """Does ``folder``'s filesystem accept ``O_DIRECT``? (A probe file is made and removed.)"""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = Path(folder) / f".shardwise-direct-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink(missing_ok=True)
    return True


def drop_cached(f: AioFile, offset: int, nbytes: int) -> None:
    """After a buffered write: the bytes to the disk, then their pages out of the cache (a hint)."""
    if f.direct:
        return
    with f.named("fdatasync after a write"):
        os.fdatasync(f.fd)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
