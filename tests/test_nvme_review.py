"""Review of the NVMe tier's failure paths: a swap file that fails its check is never rewritten as current,
and the parameters' room check counts the bytes their files hold."""

from __future__ import annotations

import errno
import os
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardwise.aio import AioError, IOEngine, open_file
from shardwise.engine.nvme import param_swap
from shardwise.errors import UserError
from shardwise.nvme import NvmeSettings, OptimizerSwapper, SwapFileError, SwapFolder

KEY = "zero_optimization.offload_optimizer.nvme_path"


def _group(numel: int) -> SimpleNamespace:
    """A group as the swapper reads it: its master, and (NVMe offload reads the gradient where the
    reduction left it) its reduced gradient, ones."""
    return SimpleNamespace(master=torch.arange(numel, dtype=torch.float32), own_numel=numel,
                           device=torch.device("cpu"), owned_grad=lambda: torch.ones(numel),
                           release_grad_shard=lambda: None)


def test_a_failed_read_under_resident_does_not_restamp_the_bad_file(tmp_path: Path) -> None:
    groups = [_group(8), _group(8)]
    opt = torch.optim.Adam([g.master for g in groups])
    swapper = OptimizerSwapper(groups, opt, NvmeSettings(nvme_path=tmp_path), rank=0)
    try:
        path = swapper.layouts[1].path
        raw = bytearray(path.read_bytes())
        raw[4096] ^= 0xFF  # a byte of group 1's master changed on disk
        path.write_bytes(bytes(raw))
        with pytest.raises(SwapFileError, match="group00001.swap"), swapper.resident(write_back=True):
            pass
        # the bad file is still refused: not rewritten from the stand-in (NaN) with a fresh stamp
        with pytest.raises(SwapFileError, match="group00001.swap"), swapper.resident(write_back=False):
            pass
    finally:
        swapper.close()


def test_the_parameters_room_check_counts_an_fp32_models_four_bytes(tmp_path: Path, monkeypatch) -> None:
    """The parameters' files hold the model's own dtype: an fp32 model's need is 4 bytes an element, not 2."""
    model = torch.nn.Linear(100, 10)  # 1010 fp32 parameters: 4040 bytes, a header and a padding block in swap files
    op = SimpleNamespace(device="nvme", nvme_path=str(tmp_path), buffer_count=2, buffer_size=1 << 20,
                         max_in_cpu=0)
    config = SimpleNamespace(zero_optimization=SimpleNamespace(offload_param=op), aio={})
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda _p: usage(1 << 30, 1 << 30, 3000))
    with pytest.raises(UserError, match=r"the swap files need .*\(12232 bytes\)"):
        swap = param_swap(config, model)
        swap.close()


def test_a_refused_optimizer_swapper_releases_its_lock_and_folder(tmp_path: Path, monkeypatch) -> None:
    """No room: the UserError, and the folder removed and its lock released at once (not at garbage
    collection: the traceback holds the half-built swapper), so a retry on the same path is not 'in use'."""
    groups = [_group(4096)]
    opt = torch.optim.Adam([g.master for g in groups])
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda _p: usage(1 << 30, 1 << 30, 1000))
    with pytest.raises(UserError, match="the swap files need") as info:
        OptimizerSwapper(groups, opt, NvmeSettings(nvme_path=tmp_path), rank=0)
    assert info.traceback and list(tmp_path.iterdir()) == []
    SwapFolder(KEY, tmp_path, rank=0).close()  # the lock is free


def test_a_stale_folder_that_cannot_be_removed_releases_the_lock(tmp_path: Path, monkeypatch) -> None:
    """A killed run's folder this user cannot remove: one line naming the key and the folder, and the lock
    released (a retry in this process is not refused as 'in use by another run')."""
    (tmp_path / "shardwise-swap" / "rank0").mkdir(parents=True)

    def denied(path, *_a, **_k):
        raise PermissionError(13, "Permission denied", str(path))

    with monkeypatch.context() as m:
        m.setattr("shutil.rmtree", denied)
        with pytest.raises(UserError, match=f"^{KEY}: cannot replace .*rank0.*Permission denied"):
            SwapFolder(KEY, tmp_path, rank=0)
    SwapFolder(KEY, tmp_path, rank=0).close()


def _refuse(*_args) -> None:
    raise RuntimeError("refused")  # as engine.offload_states()'s step hook refuses a step


@pytest.mark.parametrize("pipeline_read", [False, True])
def test_a_step_that_raises_gives_its_buffer_back(tmp_path: Path, pipeline_read: bool) -> None:
    """The optimizer raising mid-step (offload_states' hook): the buffer goes back to the free list and the
    group to its stand-ins (nothing points into a buffer that will be reused), so the next step is exact."""
    groups = [_group(8), _group(8)]
    for g in groups:
        g.publish_master = lambda async_op: None
    ref = [g.master.clone().requires_grad_() for g in groups]
    for r in ref:
        r.grad = torch.ones(8)
    torch.optim.Adam(ref).step()
    opt = torch.optim.Adam([g.master for g in groups])
    settings = NvmeSettings(nvme_path=tmp_path, buffer_count=2, pipeline_read=pipeline_read)
    swapper, sharding = OptimizerSwapper(groups, opt, settings, rank=0), SimpleNamespace(wait_for_params=lambda: None)
    try:
        hook = opt.register_step_pre_hook(_refuse)
        with pytest.raises(RuntimeError, match="refused"):
            swapper.step_and_publish(sharding)
        hook.remove()
        swapper.step_and_publish(sharding)
        with swapper.resident(write_back=False):
            assert all(torch.equal(g.master, r.detach()) for g, r in zip(groups, ref, strict=True))
    finally:
        swapper.close()


@pytest.mark.parametrize("call", ["fdatasync", "fsync"])
def test_a_buffered_files_sync_error_names_the_file(tmp_path: Path, monkeypatch, call: str) -> None:
    """Without O_DIRECT a write's error (EIO, ENOSPC) often shows at the sync: it too names the file."""
    def eio(_fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    path = tmp_path / "t.bin"
    with IOEngine() as io:
        f = open_file(path, direct=False)
        try:
            monkeypatch.setattr(os, call, eio)
            with pytest.raises(AioError, match=f"^{path}: .*Input/output error"):
                io.write(f, torch.zeros(4096, dtype=torch.uint8)).wait()
                f.sync()
        finally:
            f.close()


def test_a_lock_file_removed_before_our_flock_is_not_held(tmp_path: Path, monkeypatch) -> None:
    """The run holding the lock exits (unlinks the lock file) between our open and our flock: we must lock
    the file now at the path, not the unlinked one, or a third run locks a new file and shares the folder."""
    import fcntl

    real, calls = fcntl.flock, []

    def flock_after_the_holder_left(fd: int, op: int) -> None:
        if not calls:
            calls.append(fd)
            (tmp_path / "shardwise-swap" / "rank0.lock").unlink()
        real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_the_holder_left)
    first = SwapFolder(KEY, tmp_path, rank=0)
    monkeypatch.setattr(fcntl, "flock", real)
    try:  # the file at the path is the one held: another engine of this process takes the next folder
        second = SwapFolder(KEY, tmp_path, rank=0)
        assert second.path.name == "rank0.1"
        second.close()
    finally:
        first.close()
