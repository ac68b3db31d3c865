"""Parameters on NVMe, in one process: the swap files are stamped and checked (a truncated, stale or changed
file is an error naming it), the room check counts the node's ranks, the engine's lock is released when its
constructor fails, and the estimate counts the parameters' host buffers."""

from __future__ import annotations

import os
from collections import namedtuple
from concurrent.futures import wait
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shardwise.aio import ALIGN, AioError, IOEngine
from shardwise.errors import UserError
from shardwise.nvme import ParamSwap, SwapFileError, SwapFolder, check_room
from shardwise.nvme.swap_file import checksum

KEY = "zero_optimization.offload_param.nvme_path"
OPT_KEY = "zero_optimization.offload_optimizer.nvme_path"


def _swap(root: Path, buffer_size: int = 3000) -> ParamSwap:
    return ParamSwap(SwapFolder(KEY, root, 0, kind="param-"), IOEngine(), buffer_count=2, buffer_size=buffer_size,
                     max_in_cpu=0)


def _stored(swap: ParamSwap, values: torch.Tensor):
    store = swap.store()
    store.keep(SimpleNamespace(own_numel=values.numel(), dtype=values.dtype), values)
    return store


def _read(store, numel: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    out = torch.empty(numel, dtype=dtype)
    store.fill(None, out, async_read=False)
    return out


@pytest.mark.parametrize("numel", [5, 7001])  # one piece (padded), three pieces of 3000 elements
def test_a_parameter_file_reads_back_and_refuses_a_change_a_stale_copy_and_a_truncation(tmp_path: Path,
                                                                                        numel: int) -> None:
    swap = _swap(tmp_path)
    try:
        values = torch.randn(numel).to(torch.bfloat16)
        store = _stored(swap, values)
        assert torch.equal(_read(store, numel), values) and store.generation == 1
        stale = store.path.read_bytes()
        store.update(values * 2)  # a step: the next generation, written behind
        assert torch.equal(_read(store, numel), values * 2)  # from the write's copy, or from the file
        store.pending.result()
        assert torch.equal(_read(store, numel), values * 2) and store.generation == 2  # from the file
        current = store.path.read_bytes()
        store.path.write_bytes(stale)  # the previous write's file, intact but stale
        with pytest.raises(SwapFileError, match=r"param00000.swap: parameter swap file is generation 1 .* "
                                                r"this run wrote generation 2"):
            _read(store, numel)
        changed = bytearray(current)
        changed[ALIGN + 1] ^= 0x40  # one bit of the shard
        store.path.write_bytes(bytes(changed))
        with pytest.raises(SwapFileError, match=r"param00000.swap: parameter swap file fails its checksum"):
            _read(store, numel)
        store.path.write_bytes(current[:len(current) - ALIGN])  # truncated by a block
        with pytest.raises(AioError, match=r"param00000.swap: the file ends at byte"):
            _read(store, numel)
        store.path.write_bytes(b"\0" * len(current))  # zeroed: no header
        with pytest.raises(SwapFileError, match=r"param00000.swap: parameter swap file has no shardwise header"):
            _read(store, numel)
    finally:
        swap.close()


def test_the_pieces_sums_add_up_to_the_whole_files_sum() -> None:
    """The checksum of a shard moved in pieces is the sum of the pieces' int64 sums, wrapped as torch wraps."""
    from shardwise.nvme.param_store import wrap_sum

    data = torch.randint(-2**62, 2**62, (3 * 512,), dtype=torch.int64)
    whole = checksum(data.view(torch.uint8))
    pieces = [checksum(p.view(torch.uint8)) for p in data.split(512)]
    total = 0
    for p in pieces:
        total = wrap_sum(total + p)
    assert total == whole


def test_swap_files_are_gone_after_close(tmp_path: Path) -> None:
    swap = _swap(tmp_path)
    _stored(swap, torch.ones(10, dtype=torch.bfloat16))
    swap.close()
    assert os.listdir(tmp_path) == []


def _free(monkeypatch, nbytes: int) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda _p: usage(1 << 40, 1 << 40, nbytes))


def test_the_room_check_counts_what_the_nodes_other_ranks_wrote_already(tmp_path: Path, monkeypatch) -> None:
    """Two ranks on one disk, 1 MiB each: the rank checking after the other wrote its files sees the room the
    first saw (free + the live folder's bytes), not a disk short of the first rank's files; a killed run's
    folder is not counted."""
    mib = 1 << 20
    base = tmp_path / "shardwise-swap"
    (base / "rank1").mkdir(parents=True)
    (base / "rank1" / "group00000.swap").write_bytes(b"\0" * mib)
    (base / "rank1.lock").write_text(f"{os.getppid()}\n")  # a live process: this run's rank 1
    _free(monkeypatch, mib)
    check_room(OPT_KEY, tmp_path, mib, local_ranks=2)  # 1 MiB free + 1 MiB written = 2 ranks x 1 MiB
    with pytest.raises(UserError, match=r"free \(\+ 1\.00 MiB in this run's swap files\), the swap files for 2 "
                                        r"ranks of this node need 3\.00 MiB"):
        check_room(OPT_KEY, tmp_path, mib + mib // 2, local_ranks=2)
    (base / "rank1.lock").write_text("999999999\n")  # no such process: a killed run's folder
    with pytest.raises(UserError, match=r"has 1\.00 MiB \(1048576 bytes\) free, the swap files for 2 ranks"):
        check_room(OPT_KEY, tmp_path, mib, local_ranks=2)


def test_the_optimizers_room_check_counts_the_parameters_files_of_every_rank(tmp_path: Path, monkeypatch) -> None:
    """This process's parameter files (1 MiB) are on the disk already; the other rank's may not be: the
    optimizer's check (1 MiB a rank) needs 2 x (1 + 1) MiB, of which this rank's 1 MiB is written."""
    mib = 1 << 20
    swap = _swap(tmp_path, buffer_size=mib)
    try:
        _stored(swap, torch.zeros((mib - ALIGN) // 2, dtype=torch.bfloat16))  # with its header: exactly 1 MiB
        assert sum(f.stat().st_size for f in swap.folder.path.iterdir()) == mib
        _free(monkeypatch, 3 * mib)
        check_room(OPT_KEY, tmp_path, mib, local_ranks=2)
        _free(monkeypatch, 3 * mib - 1)
        with pytest.raises(UserError, match=r"need 4\.00 MiB \(4194304 bytes\)"):
            check_room(OPT_KEY, tmp_path, mib, local_ranks=2)
    finally:
        swap.close()


def test_a_failed_engine_constructor_releases_the_parameters_swap_folder(tmp_path: Path, monkeypatch) -> None:
    """The constructor raises after the parameters' folder was locked: the folder is gone and the lock free at
    once (the traceback, which holds the half-built engine, still alive), so a retry on the path starts."""
    import shardwise
    from shardwise.engine import engine as engine_module

    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 0, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}}

    def broken_monitor(_engine):
        raise RuntimeError("a late failure")

    monkeypatch.setattr(engine_module, "EngineMonitor", broken_monitor)
    with pytest.raises(RuntimeError, match="a late failure") as failed:
        shardwise.initialize(model=torch.nn.Linear(8, 8), config=cfg)
    assert failed.value.__traceback__ is not None and os.listdir(tmp_path) == []  # both folders and locks gone
    monkeypatch.undo()
    engine, *_ = shardwise.initialize(model=torch.nn.Linear(8, 8), config=cfg)  # not "in use"
    engine.destroy()
    assert os.listdir(tmp_path) == []


def test_a_failed_write_behind_is_raised_by_the_reads_never_a_stale_shard(tmp_path: Path, monkeypatch) -> None:
    """The step's writes run behind it on the writer thread: one that fails is raised by its store's next
    read and by those of every store written after it (their files keep the previous generation, which
    must not be read as current), and by close()."""
    swap = _swap(tmp_path)
    try:
        a, b = _stored(swap, torch.ones(6, dtype=torch.bfloat16)), _stored(swap, torch.ones(6, dtype=torch.bfloat16))
        real = swap.io.write

        def full_disk(f, t, offset=0):
            if f.path.name == "param00000.swap":
                raise AioError(f"{f.path}: write of {t.numel()} bytes at offset {offset} failed: No space left")
            return real(f, t, offset)

        monkeypatch.setattr(swap.io, "write", full_disk)
        a.update(torch.full((6,), 2.0))  # returns: the write is behind
        b.update(torch.full((6,), 3.0))
        wait(list(swap.in_flight))  # (a read before the writes end copies their data: the step's values)
        for store in (a, b):
            with pytest.raises(AioError, match=r"param00000.swap: write of .* No space left"):
                _read(store, 6)
    finally:
        with pytest.raises(AioError, match="No space left"):
            swap.close()
    assert os.listdir(tmp_path) == []


def test_a_read_while_its_write_is_behind_gets_the_new_shard(tmp_path: Path, monkeypatch) -> None:
    """The next forward may gather a group whose write is still in flight: it gets the step's values from the
    write's own host copy (no wait, and never the file's previous generation)."""
    import threading

    swap = _swap(tmp_path)
    try:
        store = _stored(swap, torch.ones(6, dtype=torch.bfloat16))
        gate, real = threading.Event(), swap.io.write
        monkeypatch.setattr(swap.io, "write", lambda f, t, offset=0: (gate.wait(), real(f, t, offset))[1])
        store.update(torch.full((6,), 2.0))
        assert torch.equal(_read(store, 6), torch.full((6,), 2.0)) and not store.pending.done()
        assert store.generation == 1  # the file still holds the first generation
        gate.set()
        store.pending.result()
        assert store.unwritten is None and store.generation == 2
        assert torch.equal(_read(store, 6), torch.full((6,), 2.0))
    finally:
        gate.set()
        swap.close()
