"""A load's shard files hashed ahead on background threads through the I/O engine (checkpoint/hash_ahead.py):
the reads are the streaming reads, bit for bit; sizes checked before a buffer is allocated; a changed
byte, wherever it is, refused naming the file; chunk boundaries and empty files hashed right."""

from __future__ import annotations

import hashlib

import pytest
import torch

from shardwise.aio import IOEngine
from shardwise.checkpoint import hash_ahead
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
