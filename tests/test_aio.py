"""shardwise.aio: the I/O engine's round trips, O_DIRECT and its fallback, alignment, errors, shutdown."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from shardwise.aio import (
    ALIGN,
    AioConfig,
    AioError,
    AlignedBuffer,
    IOEngine,
    open_file,
    read_tensor,
    takes_direct_io,
    write_tensor,
)

SHM = Path("/dev/shm")


@pytest.fixture
def io():
    with IOEngine(AioConfig(block_size=8192, queue_depth=2, intra_op_parallelism=3)) as engine:
        yield engine


def _folders(tmp_path: Path) -> list[Path]:
    """A folder that takes O_DIRECT (the test's tmp_path on a disk) and, where there is one, a tmpfs."""
    out = [tmp_path]
    if SHM.is_dir() and os.access(SHM, os.W_OK):
        shm = SHM / f"shardwise-test-aio-{os.getpid()}"
        shm.mkdir(exist_ok=True)
        out.append(shm)
    return out


def test_aligned_buffer_is_page_aligned_and_views_share_memory() -> None:
    buf = AlignedBuffer(10_000)
    assert buf.nbytes == 3 * ALIGN and buf.address % ALIGN == 0
    v = buf.view(torch.float32, ALIGN, 10)
    v.fill_(2.0)
    assert buf.tensor[ALIGN:ALIGN + 40].view(torch.float32).eq(2.0).all()
    with pytest.raises(ValueError, match="outside the buffer"):
        buf.view(torch.float32, 3 * ALIGN - 4, 2)
    buf.close()
    assert v.eq(2.0).all()  # a view keeps the mapping alive: no dangling memory


def _refuse_direct(monkeypatch) -> None:
    """The filesystem of a kernel before 6.6's tmpfs: open(O_DIRECT) fails with EINVAL."""
    real = os.open

    def fake(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args)

    monkeypatch.setattr(os, "open", fake)


@pytest.mark.parametrize("refused", [False, True])
def test_round_trip_direct_and_fallback(tmp_path: Path, io: IOEngine, caplog, monkeypatch, refused: bool) -> None:
    """Bytes come back bit for bit through O_DIRECT (a disk; tmpfs too since Linux 6.6) and through the
    logged fallback where the filesystem refuses O_DIRECT (EINVAL, as tmpfs before 6.6 does)."""
    src = AlignedBuffer(5 * ALIGN + 100)
    torch.manual_seed(0)
    src.tensor.copy_(torch.randint(0, 256, (src.nbytes,), dtype=torch.uint8))
    direct = {folder: takes_direct_io(folder) for folder in _folders(tmp_path)}
    if refused:
        _refuse_direct(monkeypatch)
    for folder in direct:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shardwise"):
            f = open_file(folder / "x.swap")
        try:
            assert f.direct == (direct[folder] and not refused)
            if refused:
                assert "does not take O_DIRECT" in caplog.text and str(folder) in caplog.text
            io.write(f, src.tensor, offset=ALIGN).wait()
            dst = AlignedBuffer(src.nbytes)
            io.read(f, dst.tensor, offset=ALIGN).wait()
            assert torch.equal(dst.tensor, src.tensor)
        finally:
            f.close()
            (folder / "x.swap").unlink()
    assert io.bytes_read == io.bytes_written == src.nbytes * len(direct)


def test_direct_io_refuses_unaligned_requests(tmp_path: Path, io: IOEngine) -> None:
    if not takes_direct_io(tmp_path):
        pytest.skip("this filesystem does not take O_DIRECT")
    f = open_file(tmp_path / "x.swap")
    try:
        buf = AlignedBuffer(2 * ALIGN)
        with pytest.raises(ValueError, match="aligned to 4096"):
            io.write(f, buf.tensor[1:ALIGN + 1])
        with pytest.raises(ValueError, match="aligned to 4096"):
            io.write(f, buf.tensor, offset=512)
    finally:
        f.close()


def test_short_read_names_the_file(tmp_path: Path, io: IOEngine) -> None:
    buf = AlignedBuffer(4 * ALIGN)
    f = open_file(tmp_path / "short.swap")
    try:
        io.write(f, buf.tensor).wait()
        f.truncate(2 * ALIGN)  # changed underneath
        with pytest.raises(AioError, match=r"short\.swap: the file ends at byte 8192"):
            io.read(f, buf.tensor).wait()
    finally:
        f.close()


def test_whole_tensors_any_dtype_and_alignment(tmp_path: Path, io: IOEngine) -> None:
    """write_tensor / read_tensor: an unaligned bf16 tensor of odd length, through a bounce buffer."""
    t = torch.randn(1001, dtype=torch.float32).to(torch.bfloat16)[1:]
    write_tensor(io, tmp_path / "t.bin", t)
    assert (tmp_path / "t.bin").stat().st_size == t.numel() * 2
    out = torch.empty(1000, dtype=torch.bfloat16)
    assert torch.equal(read_tensor(io, tmp_path / "t.bin", out), t)
    with pytest.raises(AioError, match="t.bin: 2000 bytes on disk, 4000 expected"):
        read_tensor(io, tmp_path / "t.bin", torch.empty(1000, dtype=torch.float32))


def test_a_read_does_not_hold_the_gil(tmp_path: Path) -> None:
    """The main thread keeps running Python while a worker reads (os.preadv drops the GIL)."""
    buf = AlignedBuffer(64 << 20)
    with IOEngine() as io:
        f = open_file(tmp_path / "big.swap")
        try:
            io.write(f, buf.tensor).wait()
            t0 = time.perf_counter()
            handle, ticks = io.read(f, buf.tensor), 0
            while not handle.done():
                ticks += 1
            seconds = time.perf_counter() - t0
            handle.wait()
            # a read holding the GIL would leave the loop no turn until it returned; one that releases it
            # leaves the main thread millions of turns a second (over 1,000 in any read longer than 5 ms)
            assert seconds < 0.005 or ticks > 1000, (seconds, ticks)
        finally:
            f.close()


def test_close_waits_for_transfers_and_stops_threads(tmp_path: Path) -> None:
    before = {t.name for t in threading.enumerate()}
    io = IOEngine(AioConfig(intra_op_parallelism=2))
    buf = AlignedBuffer(8 << 20)
    f = open_file(tmp_path / "w.swap")
    handle = io.write(f, buf.tensor)
    io.close()
    assert handle.done()
    handle.wait()
    f.close()
    assert not {t.name for t in threading.enumerate() if t.name.startswith("shardwise-aio")} - before


@pytest.mark.parametrize("bad", [{"block_size": 1000}, {"queue_depth": 0}, {"intra_op_parallelism": -1}])
def test_config_is_checked(bad: dict) -> None:
    with pytest.raises(ValueError, match=f"aio.{next(iter(bad))}"):
        AioConfig(**bad)
