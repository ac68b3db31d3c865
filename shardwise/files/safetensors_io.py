"""The one safetensors reader and the one dtype table, for every path that reads weights from files.

zero.Init (``SafetensorsSource``), ZeRO-Inference (``SafetensorsReader``), the quantized store and
checkpoint shards (``ShardReader``) all read tensors through :class:`SafetensorsFile`. Each keeps
only its folder-level concerns (index files, name aliases, checkpoint hashes, quantization
metadata); the header is parsed and checked here, once per file, so a hostile or damaged header
is refused the same way whichever path meets it.

Files are read with ``pread`` straight into the caller's tensor (through the library's one I/O engine,
``shardwise.aio``), never mmapped: ZeRO-Inference's memory bound relies on pages of layers already used
not staying mapped into the process.
"""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.aio import AioFile, shared_engine
from shardwise.files.safe import open_regular

# safetensors dtype name <-> torch dtype: the only such table in shardwise
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool}
ST_NAMES: dict[torch.dtype, str] = {v: k for k, v in ST_DTYPES.items()}
_TORCH_NAMES = {str(d).removeprefix("torch."): d for d in ST_NAMES}
MAX_HEADER = 100 << 20  # a longer JSON header is damage (or an attempt to exhaust memory)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the names checkpoint metadata and configs use)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` / ``"bf16"`` / ``"torch.float16"`` -> torch dtype, for dtypes files can hold."""
    alias = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
             "float": "float32"}
    key = name.removeprefix("torch.")
    key = alias.get(key, key)
    if key not in _TORCH_NAMES:
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, bf16, fp16 or a torch dtype name")
    return _TORCH_NAMES[key]


def read_into(fd: int, pos: int, dst: torch.Tensor, what: str) -> None:
    """``dst``'s bytes read at ``pos`` straight into the contiguous CPU tensor ``dst``, through the library's
    one I/O engine (``shardwise.aio.shared_engine().read_now``: its ``preadv`` calls, which release the
    GIL, on the calling thread, ZeRO-Inference's reader thread; a short read is an ``AioError`` naming
    ``what``). Buffered, not ``O_DIRECT``: a safetensors tensor starts at any byte."""
    if dst.numel() == 0:
        return
    shared_engine().read_now(AioFile(Path(what), fd, direct=False), dst, pos)


@dataclass(frozen=True)
class TensorInfo:
    """One header entry, checked: ``offset`` is the absolute byte position of element 0."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class SafetensorsFile:
    """One safetensors file, its header validated when opened; element and byte ranges by ``pread``.

    Refused, with the file named (``ValueError``): a header length outside the file or over
    ``MAX_HEADER``, a header that is not a JSON object, an entry with an unknown dtype, a shape or
    offsets that are not counts, a byte span that is not shape x element size, a span outside
    the file, and two tensors whose bytes overlap. After that every read is a plain range of a
    known tensor, so no later read can be reinterpreted or run off the file.

    ``bytes_read`` counts what was read (tests prove each rank reads only its slices). With
    ``SHARDWISE_COLD_READS=1`` (a benchmark knob) the pages are dropped after each read, as a
    model larger than RAM forces, so every read really goes to the disk.
    """

    STAGE_BYTES = 4 << 20  # converted reads go through this much staging per thread (reused)

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.bytes_read = 0
        self.cold = os.environ.get("SHARDWISE_COLD_READS") == "1"
        self._lock = threading.Lock()  # the inference reader thread and a synchronous gather
        self._staging = threading.local()  # per reading thread: the buffer of _read_converted
        self.fd = open_regular(self.path, ValueError)  # a FIFO or device is refused, never blocks
        try:
            self.size = os.fstat(self.fd).st_size
            self.tensors, self.metadata = self._parse()
        except BaseException:
            self.close()
            raise

    def _parse(self) -> tuple[dict[str, TensorInfo], dict]:
        path, size = self.path, self.size
        head_len = int.from_bytes(os.pread(self.fd, 8, 0), "little") if size >= 8 else -1
        if not 0 < head_len <= min(size - 8, MAX_HEADER):
            raise ValueError(f"{path}: not a safetensors file (header length {head_len}, file {size} bytes)")
        try:
            header = json.loads(os.pread(self.fd, head_len, 8))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ValueError(f"{path}: unreadable safetensors header ({e})"[:500]) from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: safetensors header is a {type(header).__name__}, not a JSON object")
        meta = header.pop("__metadata__", {})
        if not isinstance(meta, dict):
            raise ValueError(f"{path}: safetensors __metadata__ is not a JSON object")
        base = 8 + head_len
        tensors = {key: self._entry(key, info, base) for key, info in header.items()}
        spans = sorted((t.offset, t.offset + t.nbytes, k) for k, t in tensors.items() if t.nbytes)
        for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
            if start < end:
                raise ValueError(f"{path}: tensors {first!r} and {second!r} overlap in the file: "
                                 "the header is damaged")
        return tensors, meta

    def _entry(self, key: str, info: object, base: int) -> TensorInfo:
        path = self.path
        dt = info.get("dtype") if isinstance(info, dict) else None
        if dt not in ST_DTYPES:
            raise ValueError(f"{path}: tensor {key!r} has dtype {dt!r}, which shardwise cannot stream "
                             f"(supported: {', '.join(ST_DTYPES)}); convert the checkpoint first")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or len(shape) > 64 or not all(_is_count(s) for s in shape):
            raise ValueError(f"{path}: tensor {key!r} has shape {shape!r}, not a list of counts")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
            raise ValueError(f"{path}: tensor {key!r} has data_offsets {offsets!r}, not two byte counts")
        dtype, (a, b) = ST_DTYPES[dt], offsets
        want = math.prod(shape) * dtype.itemsize
        if b - a != want or base + b > self.size:
            raise ValueError(f"{path}: tensor {key!r} is {dt} {shape} = {want} bytes but its header "
                             f"gives bytes [{a}, {b}) of a {self.size}-byte file: header and data disagree")
        return TensorInfo(dtype, tuple(shape), base + a, want)

    def info(self, key: str) -> TensorInfo:
        try:
            return self.tensors[key]
        except KeyError:
            raise KeyError(f"{self.path}: tensor {key!r} is not in the file") from None

    def read(self, key: str, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor ``key``: into ``out`` if given (converted to
        its dtype and device; read in place when it is a contiguous CPU tensor of the stored
        dtype), else a new 1-D tensor of the stored dtype."""
        t = self.info(key)
        if not 0 <= start <= end <= t.numel:
            raise ValueError(f"{self.path}: elements [{start}, {end}) of {key!r}, which has {t.numel}")
        if out is not None and out.numel() != end - start:
            raise ValueError(f"{self.path}: {end - start} elements of {key!r} into a tensor of {out.numel()}")
        direct = out is not None and out.dtype == t.dtype and out.device.type == "cpu" and out.is_contiguous()
        if out is not None and not direct and out.is_contiguous():
            self._read_converted(key, start, end, out.view(-1))
            return out
        dst = out if direct else torch.empty(end - start, dtype=t.dtype)
        self.read_raw(key, start * t.dtype.itemsize, dst)
        if out is not None and not direct:
            out.copy_(dst.view(out.shape))
        return dst if out is None else out

    def _read_converted(self, key: str, start: int, end: int, flat_out: torch.Tensor) -> None:
        """A read into another dtype or device (streaming a fp32 file in bf16, into a GPU buffer)
        through one reused staging buffer per thread, ``STAGE_BYTES`` at a time: no parameter-sized
        temporary per gather, whose malloc/free churn leaves RSS to the allocator's heuristics (see
        ``zero/gather_pool.py``)."""
        dtype = self.tensors[key].dtype
        step = max(1, self.STAGE_BYTES // dtype.itemsize)
        stage = getattr(self._staging, "buf", None)
        if stage is None or stage.numel() < self.STAGE_BYTES:
            stage = self._staging.buf = torch.empty(self.STAGE_BYTES, dtype=torch.uint8)
        for lo in range(start, end, step):
            hi = min(end, lo + step)
            buf = stage[:(hi - lo) * dtype.itemsize].view(dtype)
            self.read_raw(key, lo * dtype.itemsize, buf)
            flat_out[lo - start:hi - start].copy_(buf)

    def read_tensor(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` with its stored dtype and shape."""
        t = self.info(key)
        return self.read(key, 0, t.numel).view(t.shape)

    def read_raw(self, key: str, byte_start: int, dst: torch.Tensor) -> None:
        """``dst``'s size in bytes from byte ``byte_start`` of ``key``'s data, whatever ``dst``'s dtype
        (the quantized store reads packed bytes and scales this way). Every read goes through here."""
        t = self.info(key)
        n = dst.numel() * dst.element_size()
        if dst.device.type != "cpu" or not dst.is_contiguous():  # pread writes through its pointer
            raise ValueError(f"{self.path}: {key!r} is read into contiguous CPU tensors only")
        if not 0 <= byte_start <= byte_start + n <= t.nbytes:
            raise ValueError(f"{self.path}: bytes [{byte_start}, {byte_start + n}) of {key!r}, which has {t.nbytes}")
        read_into(self.fd, t.offset + byte_start, dst, f"{self.path} ({key})")
        if self.cold:
            os.posix_fadvise(self.fd, t.offset + byte_start, n, os.POSIX_FADV_DONTNEED)
        with self._lock:
            self.bytes_read += n

    def close(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:  # a reader dropped without close() must not leak its descriptor
        self.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
