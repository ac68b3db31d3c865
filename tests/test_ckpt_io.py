"""Checkpoint file I/O through shardwise/aio. Loads (checkpoint/hash_ahead.py): files hashed ahead on
background threads, the reads the streaming reads bit for bit; sizes checked before a buffer is
allocated; a changed byte, wherever it is, refused naming the file; chunk boundaries and empty files
hashed right. Saves (shard_writer.write_shard_engine): the buffered writer's bytes, sha256 and size."""

from __future__ import annotations

import hashlib

import pytest
import torch

from shardwise.aio import IOEngine
from shardwise.checkpoint import hash_ahead, shard_writer
from shardwise.checkpoint.fileio import CheckpointError, ShardReader
from shardwise.checkpoint.shard_writer import write_shard


def _folder(tmp_path, n_files: int = 3) -> tuple[dict, dict]:
    """Files whose bf16 tensors of odd length leave the next fp32 tensor's bytes misaligned."""
    g = torch.Generator().manual_seed(0)
    files, tensors = {}, {}
    for i in range(n_files):
        pieces = [(f"master/w{i}", torch.randn(3001 + i, generator=g).bfloat16()),
                  (f"exp_avg/w{i}", torch.randn(70_001, generator=g)),
                  (f"module/b{i}", torch.randn(5, 7, generator=g))]
        name = f"rank{i:05d}.safetensors"
        sha, size = write_shard(tmp_path / name, pieces)
        files[name] = {"file": name, "sha256": sha, "bytes": size}
        tensors.update({k: (name, t) for k, t in pieces})
    return files, tensors


def _read_all(reader: ShardReader, tensors: dict) -> dict[str, torch.Tensor]:
    out = {}
    for key, (fname, t) in tensors.items():
        if key.startswith("module/"):
            out[key] = reader.read_full(key, fname, torch.float64, list(t.shape), stored=t.dtype)
            continue
        seg = [{"file": fname, "start": 0, "stop": t.numel()}]
        for dtype in (t.dtype, torch.float32, torch.float64):  # in place, and converting reads
            buf = torch.empty(t.numel() - 10, dtype=dtype)
            reader.read_range(key, seg, 3, t.numel() - 7, buf, stored=t.dtype)
            out[f"{key}:{dtype}"] = buf
    return out


def test_reads_while_hashing_are_the_streaming_reads_bit_for_bit(tmp_path):
    files, tensors = _folder(tmp_path)
    streamed = _read_all(ShardReader(tmp_path, files), tensors)
    reader = ShardReader(tmp_path, files)
    reader.verify_ahead(list(files))
    ahead = _read_all(reader, tensors)
    reader.wait_verified()
    assert streamed.keys() == ahead.keys()
    for k in streamed:
        assert streamed[k].dtype == ahead[k].dtype and torch.equal(streamed[k], ahead[k]), k
    key, (fname, t) = next(iter(tensors.items()))  # and against the tensor written
    assert torch.equal(ahead[f"{key}:{t.dtype}"], t[3:-7])
    reader.release()


@pytest.mark.parametrize("size", [0, 1, 4096, 3 * 4096 + 17, 9 * 4096])
def test_chunks_and_ring_hash_every_byte(tmp_path, monkeypatch, size):
    monkeypatch.setattr(hash_ahead, "CHUNK", 4096)  # 9 chunks through a ring of 4
    data = bytes(range(256)) * (size // 256 + 1)
    (tmp_path / "f").write_bytes(data[:size])
    with IOEngine(hash_ahead.IO) as io:
        hash_ahead.hash_file(io, tmp_path / "f", size, hashlib.sha256(data[:size]).hexdigest())
        with pytest.raises(CheckpointError, match="sha256 mismatch"):
            hash_ahead.hash_file(io, tmp_path / "f", size, hashlib.sha256(b"x").hexdigest())
        if size:
            with pytest.raises(CheckpointError, match=r"/f: cannot read"):  # shorter than the metadata says
                hash_ahead.hash_file(io, tmp_path / "f", size + 4096, "0" * 64)


@pytest.mark.parametrize("where", [0, -3])  # the header's first byte, the last tensor's last bytes
def test_a_changed_byte_is_refused_by_name_before_anything_is_used(tmp_path, where):
    files, tensors = _folder(tmp_path, 2)
    victim = tmp_path / "rank00001.safetensors"
    raw = bytearray(victim.read_bytes())
    raw[where] ^= 1
    victim.write_bytes(bytes(raw))
    reader = ShardReader(tmp_path, files)
    reader.verify_ahead(list(files))
    if where:  # the slices are read meanwhile; the mismatch comes at the wait
        _read_all(reader, {k: v for k, v in tensors.items() if v[0].startswith("rank00000")})
    with pytest.raises(CheckpointError, match=r"rank00001.safetensors: sha256 mismatch"):
        reader.wait_verified()
    verify_off = ShardReader(tmp_path, files, verify=False)  # sizes only
    verify_off.verify_ahead(list(files))
    verify_off.wait_verified()


def test_sizes_are_checked_before_any_buffer(tmp_path, monkeypatch):
    files, _ = _folder(tmp_path, 2)
    victim = tmp_path / "rank00001.safetensors"
    victim.write_bytes(victim.read_bytes()[:-100])
    allocated = []
    monkeypatch.setattr(hash_ahead, "AlignedBuffer", lambda n: allocated.append(n))
    with pytest.raises(CheckpointError, match=r"rank00001.safetensors: file is truncated"):
        ShardReader(tmp_path, files).verify_ahead(["rank00001.safetensors", "rank00000.safetensors"])
    assert allocated == []
    with pytest.raises(CheckpointError, match="not listed"):
        ShardReader(tmp_path, files).verify_ahead(["rank00009.safetensors"])


@pytest.mark.parametrize("chunk", [4096, 3 * 4096, 8 << 20])  # many chunks through the ring of 4, and one
def test_the_engine_writer_writes_the_buffered_writers_bytes(tmp_path, monkeypatch, chunk):
    g = torch.Generator().manual_seed(1)
    pieces = [("master/a", torch.randn(3001, generator=g).bfloat16()), ("exp_avg/a", torch.randn(7, 9, generator=g)),
              ("step/a", torch.tensor(3.0)), ("module/mask", torch.rand(33, generator=g) > 0.5),
              ("exp_avg_sq/a", torch.randn(9000, generator=g)[::3])]  # a strided view, as staged pieces can be
    phases = []
    monkeypatch.setattr(shard_writer, "at_phase", phases.append)
    monkeypatch.setattr(shard_writer, "ENGINE", False)
    want = shard_writer.write_shard(tmp_path / "buffered.safetensors", pieces)
    monkeypatch.setattr(shard_writer, "CHUNK", chunk)
    (tmp_path / "engine.safetensors").write_bytes(b"x" * 100_000)  # a longer file at the name is replaced
    got = shard_writer.write_shard_engine(tmp_path / "engine.safetensors", pieces)
    assert got == want and got[1] == (tmp_path / "buffered.safetensors").stat().st_size
    assert (tmp_path / "engine.safetensors").read_bytes() == (tmp_path / "buffered.safetensors").read_bytes()
    assert phases == ["writing", "fsync"] * 2
    assert hashlib.sha256((tmp_path / "engine.safetensors").read_bytes()).hexdigest() == got[0]


def test_an_error_in_the_engine_writer_is_raised(tmp_path, monkeypatch):
    def full(phase: str) -> None:
        if phase == "fsync":
            raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(shard_writer, "at_phase", full)
    with pytest.raises(OSError, match="No space left"):
        shard_writer.write_shard_engine(tmp_path / "f.safetensors", [("a", torch.ones(10))])


def test_at_exit_the_engine_writer_writes_on_its_own_thread(tmp_path, monkeypatch):
    """A pending save completed at interpreter exit: no engine thread can start there (the submit raises
    RuntimeError); the chunks are written on the writer's thread, the same bytes."""
    pieces = [("a", torch.arange(50_000, dtype=torch.float32)), ("b", torch.ones(3, dtype=torch.bfloat16))]
    monkeypatch.setattr(shard_writer, "ENGINE", False)  # the buffered body, for the expected bytes
    expected = shard_writer.write_shard(tmp_path / "buffered", pieces)

    def refuse(*_a, **_k):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(shard_writer.IOEngine, "write", refuse)
    monkeypatch.setattr(shard_writer, "CHUNK", 4096 * 5)
    assert shard_writer.write_shard_engine(tmp_path / "engine", pieces) == expected
    assert (tmp_path / "engine").read_bytes() == (tmp_path / "buffered").read_bytes()
