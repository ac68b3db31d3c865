"""A load's shard files read whole through the I/O engine (checkpoint/prefetch.py): the same values as
the streaming reads, bit for bit (misaligned tensors and converting reads included); sizes checked
before a buffer is allocated; a changed byte refused naming the file; the memory budget honoured."""

from __future__ import annotations

import pytest
import torch

from shardwise.checkpoint import prefetch
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


def test_prefetched_reads_are_the_streaming_reads_bit_for_bit(tmp_path):
    files, tensors = _folder(tmp_path)
    streamed = _read_all(ShardReader(tmp_path, files), tensors)
    reader = ShardReader(tmp_path, files)
    assert reader.prefetch(list(files)) == list(files)
    fetched = _read_all(reader, tensors)
    assert streamed.keys() == fetched.keys()
    for k in streamed:
        assert streamed[k].dtype == fetched[k].dtype and torch.equal(streamed[k], fetched[k]), k
    key, (fname, t) = next(iter(tensors.items()))  # and against the tensor written
    assert torch.equal(fetched[f"{key}:{t.dtype}"], t[3:-7])
    reader.release()


def test_the_budget_leaves_files_to_the_streaming_reads(tmp_path):
    files, tensors = _folder(tmp_path)
    sizes = [f["bytes"] for f in files.values()]
    reader = ShardReader(tmp_path, files)
    assert reader.prefetch(list(files), budget=sizes[0] + sizes[1] // 2) == ["rank00000.safetensors"]
    assert reader.prefetch(list(files), budget=0) == []
    streamed = _read_all(ShardReader(tmp_path, files), tensors)
    assert all(torch.equal(v, streamed[k]) for k, v in _read_all(reader, tensors).items())


def test_a_bad_file_is_refused_by_name_before_allocating(tmp_path, monkeypatch):
    files, _ = _folder(tmp_path, 2)
    victim = tmp_path / "rank00001.safetensors"
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 1  # one bit of the last tensor
    victim.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"rank00001.safetensors: sha256 mismatch"):
        ShardReader(tmp_path, files).prefetch(list(files))
    ShardReader(tmp_path, files, verify=False).prefetch(list(files))  # verify=False: sizes only
    victim.write_bytes(bytes(raw[:-100]))
    allocated = []
    monkeypatch.setattr(prefetch, "AlignedBuffer", lambda n: allocated.append(n))
    with pytest.raises(CheckpointError, match=r"rank00001.safetensors: file is truncated"):
        ShardReader(tmp_path, files).prefetch(list(files))
    assert allocated == []  # every size checked before the first buffer
    with pytest.raises(CheckpointError, match="not listed"):
        ShardReader(tmp_path, files).prefetch(["rank00009.safetensors"])
