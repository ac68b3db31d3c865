"""The one safetensors reader (issue 14 item 3): crafted headers are refused with the file named,
and every range it reads equals what safetensors' own ``load_file`` gives for the same file."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardwise.checkpoint.fileio import SafetensorsWriter
from shardwise.files.safetensors_io import MAX_HEADER, ST_DTYPES, ST_NAMES, SafetensorsFile, dtype_from_name


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 5, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16),
            "i": torch.randint(-100, 100, (3, 4), generator=g, dtype=torch.int64),
            "h": torch.randn(2, 3, 4, generator=g).half(), "s": torch.tensor(3.5, dtype=torch.float64),
            "m": torch.tensor([True, False, True]), "e": torch.empty(0, 3)}


def _write(path: Path, header: object, data: bytes = b"", head_len: int | None = None) -> Path:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    raw += b" " * (-len(raw) % 8)
    path.write_bytes((len(raw) if head_len is None else head_len).to_bytes(8, "little") + raw + data)
    return path


def _refused(path: Path, pattern: str) -> None:
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + pattern):
        SafetensorsFile(path)


def test_range_reads_equal_load_file(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(_tensors(), str(path))
    want = load_file(str(path))
    with SafetensorsFile(path) as f:
        assert set(f.tensors) == set(want)
        for key, t in want.items():
            assert torch.equal(f.read_tensor(key), t) and f.read_tensor(key).dtype == t.dtype
            flat, n = t.reshape(-1), t.numel()
            for lo, hi in [(0, n), (n // 3, n - n // 4), (n, n), (max(0, n - 1), n)]:
                assert torch.equal(f.read(key, lo, hi), flat[lo:hi])
                out = torch.full((hi - lo,), 7, dtype=torch.float32)  # converted on the way
                f.read(key, lo, hi, out)
                assert torch.equal(out, flat[lo:hi].float())
        raw = torch.empty(8, dtype=torch.uint8)
        f.read_raw("w", 4 * 3, raw)  # bytes of elements 3 and 4, as stored
        assert torch.equal(raw.view(torch.float32), want["w"].reshape(-1)[3:5])
        assert f.bytes_read > 0
        with pytest.raises(ValueError, match="elements"):
            f.read("w", 0, 31)
        with pytest.raises(KeyError, match="'nope' is not in the file"):
            f.read("nope", 0, 1)
        with pytest.raises(ValueError, match="contiguous CPU"):
            f.read_raw("w", 0, torch.empty(4, 4).t())


def test_streamed_writer_files_read_back(tmp_path):
    """Files of the checkpoint writer (planned header, streamed bytes) read through the same reader."""
    ts = _tensors()
    w = SafetensorsWriter(tmp_path / "c.safetensors", [(k, t.dtype, tuple(t.shape)) for k, t in ts.items()])
    for k, t in ts.items():
        w.write(k, t)
    w.close()
    with SafetensorsFile(tmp_path / "c.safetensors") as f:
        for k, t in ts.items():
            assert torch.equal(f.read_tensor(k), t)


def test_dtype_table_is_one():
    assert {ST_DTYPES[n]: n for n in ST_DTYPES} == ST_NAMES
    for dt in ST_NAMES:
        assert dtype_from_name(str(dt)) == dt
    assert dtype_from_name("bf16") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_from_name("float8")


def _entry(dtype: str = "F32", shape: list | None = None, offsets: list | None = None) -> dict:
    return {"dtype": dtype, "shape": [2, 2] if shape is None else shape,
            "data_offsets": [0, 16] if offsets is None else offsets}


@pytest.mark.parametrize(("header", "pattern"), [
    ({"a": _entry(dtype="F8_E4M3")}, r"'a' has dtype 'F8_E4M3'.*cannot stream"),
    ({"a": _entry(dtype=None)}, r"'a' has dtype None"),
    ({"a": [1, 2]}, r"'a' has dtype None"),
    ({"a": _entry(shape=[2, 3])}, "header and data disagree"),
    ({"a": _entry(offsets=[16, 0])}, "header and data disagree"),
    ({"a": _entry(offsets=[8, 24])}, "header and data disagree"),  # runs 8 bytes past the end
    ({"a": _entry(offsets=[0, 16]), "b": _entry(shape=[1], offsets=[12, 16])}, "'a' and 'b' overlap"),
    ({"a": _entry(shape=[2, -2])}, "not a list of counts"),
    ({"a": _entry(shape=[2, True])}, "not a list of counts"),
    ({"a": _entry(shape="22")}, "not a list of counts"),
    ({"a": _entry(offsets=[0])}, "not two byte counts"),
    ({"a": _entry(offsets=[0, 16.0])}, "not two byte counts"),
    ({"a": _entry(offsets=[-4, 12])}, "not two byte counts"),
    ([_entry()], "header is a list, not a JSON object"),
    ("text", "header is a str, not a JSON object"),
    ({"__metadata__": [1], "a": _entry()}, "__metadata__ is not a JSON object"),
    (b"\xff\xfe{", "unreadable safetensors header"),
    (b"{" * 100_000, "unreadable safetensors header"),  # nesting deeper than the parser's recursion
])
def test_crafted_header_refused(tmp_path, header, pattern):
    _refused(_write(tmp_path / "bad.safetensors", header, b"\0" * 16), pattern)


@pytest.mark.parametrize("head_len", [0, 2**63, MAX_HEADER + 8, 10_000])
def test_header_length_refused(tmp_path, head_len):
    _refused(_write(tmp_path / "bad.safetensors", {"a": _entry()}, b"\0" * 16, head_len=head_len),
             "not a safetensors file")


def test_huge_header_length_not_allocated(tmp_path):
    """A header length beyond MAX_HEADER is refused before reading, even when the file is that big."""
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write((MAX_HEADER + 8).to_bytes(8, "little"))
        f.truncate(MAX_HEADER + 64)  # sparse
    _refused(path, "header length")


def test_short_file_refused(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\1\0\0")
    _refused(path, "not a safetensors file")


def test_no_descriptor_left_open(tmp_path):
    path = _write(tmp_path / "bad.safetensors", {"a": _entry(dtype="X")}, b"\0" * 16)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(ValueError):
            SafetensorsFile(path)
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.parametrize(("dim", "full", "size", "parts"), [(0, 9, 2, 1), (1, 6, 2, 3), (2, 5, 3, 1), (1, 7, 4, 1)])
def test_tp_slices_read_by_ranges_equal_take(tmp_path, dim, full, size, parts):
    """Every rank's TP slice read by element ranges equals ``ShardSpec.take`` of the whole tensor
    (fused parts, vocabulary padding, any dim)."""
    from shardwise.tensor_parallel.layers import ShardSpec, read_tp_slice

    shape = [3, 4, 5]
    shape[dim] = full
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    save_file({"t": t}, str(tmp_path / "m.safetensors"))
    with SafetensorsFile(tmp_path / "m.safetensors") as f:
        for rank in range(size):
            spec = ShardSpec(dim, full, size, rank, parts)
            want = spec.take(t)
            out = torch.full((want.numel(),), float("nan"))
            read_tp_slice(f, "t", spec, tuple(want.shape), 0, want.numel(), out)
            assert torch.equal(out.view(want.shape), want)


def test_zero_init_source_refuses_other_shape(tmp_path):
    """zero.Init reads exact ranges, and refuses a stored tensor whose shape is not the parameter's
    (its elements would belong to other rows), naming the file."""
    from shardwise.sharded_init.context import SafetensorsSource

    ts = _tensors()
    save_file(ts, str(tmp_path / "model.safetensors"))
    src = SafetensorsSource(tmp_path)
    assert torch.equal(src.read("x", torch.Size([6, 5]), 7, 23, aliases=["w"]), ts["w"].reshape(-1)[7:23])
    assert src.bytes_read == 16 * 4
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'w' is stored with shape \[6, 5\].*\[5, 6\]"):
        src.read("w", torch.Size([5, 6]), 0, 30, aliases=[])


def test_converted_reads_go_through_bounded_staging(tmp_path, monkeypatch):
    """A read into another dtype is staged a few bytes at a time (here 24: 6 fp32 elements) through
    one reused buffer per thread, and equals the whole-range conversion, also from two threads."""
    import threading

    path = tmp_path / "m.safetensors"
    w = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    save_file({"w": w}, str(path))
    monkeypatch.setattr(SafetensorsFile, "STAGE_BYTES", 24)
    with SafetensorsFile(path) as f:
        for lo, hi in [(0, 1000), (5, 6), (7, 20), (995, 1000)]:
            out = torch.empty(hi - lo, dtype=torch.bfloat16)
            assert f.read("w", lo, hi, out) is out and torch.equal(out, w[lo:hi].bfloat16())
        got: dict[int, torch.Tensor] = {}

        def reader(i: int) -> None:
            got[i] = torch.empty(1000, dtype=torch.float64)
            for _ in range(20):
                f.read("w", 0, 1000, got[i])

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(torch.equal(g, w.double()) for g in got.values())


def test_reads_go_through_the_libraries_io_engine_and_a_short_read_names_the_file(tmp_path) -> None:
    """ZeRO-Inference's disk tier reads through ``shardwise.aio`` (its shared engine counts the bytes); a
    file cut short after its header was checked is an AioError naming the file and the tensor."""
    from shardwise.aio import AioError, shared_engine

    path = tmp_path / "m.safetensors"
    save_file({"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(1000)}, str(path))
    with SafetensorsFile(path) as f:
        before = shared_engine().bytes_read
        assert torch.equal(f.read_tensor("a"), torch.arange(1000, dtype=torch.float32))
        assert shared_engine().bytes_read - before == 4000
        os.truncate(path, f.info("b").offset + 100)
        with pytest.raises(AioError, match=r"m\.safetensors \(b\): the file ends at byte"):
            f.read_tensor("b")
