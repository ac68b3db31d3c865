"""File-level pieces of the checkpoint format: streaming safetensors writer, verified reader, JSON.

The writer plans the safetensors header from shapes up front and then streams each tensor's bytes,
so neither a rank's shard file nor a consolidated HF file is ever built in memory (and views of
the flat buffers are written without copies). The reader checks each file's size and sha256
against the metadata before opening it with the one safetensors reader
(:class:`~shardwise.files.safetensors_io.SafetensorsFile`: no pickle, header validated), so a corrupt
or truncated file is refused by name before any of its bytes are used.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.checkpoint import hash_ahead
from shardwise.checkpoint.format import FORMAT, VERSION, CheckpointError, read_json  # noqa: F401 (re-exported)
from shardwise.comm import Comm, CommStats, compute_device, make_comm
from shardwise.files.safe import finite_json, open_regular, write_atomic
from shardwise.files.safetensors_io import ST_NAMES, SafetensorsFile, dtype_from_name, dtype_name

__all__ = ["CheckpointError", "SafetensorsWriter", "ShardReader", "dtype_from_name", "dtype_name",
           "safetensors_header"]


def safetensors_header(specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
                       ) -> tuple[bytes, list[tuple[str, torch.dtype, tuple[int, ...]]]]:
    """The bytes a safetensors file starts with (length, JSON header padded to 8) for tensors laid out
    in the order of ``specs``, and that order (name, dtype, shape)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    order: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    pos = 0
    for name, dtype, shape in specs:
        n = 1
        for s in shape:
            n *= int(s)
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": ST_NAMES[dtype], "shape": [int(s) for s in shape], "data_offsets": [pos, pos + nbytes]}
        order.append((name, dtype, tuple(int(s) for s in shape)))
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, order


def check_planned(path: Path, planned: tuple[str, torch.dtype, tuple[int, ...]], name: str,
                  tensor: torch.Tensor) -> None:
    """``tensor`` is the planned next one of a safetensors file being written (name, dtype, shape), or
    ValueError naming the file."""
    want, dtype, shape = planned
    if name != want or tensor.dtype != dtype or tuple(tensor.shape) != shape:
        raise ValueError(f"{path.name}: expected {want} {dtype} {shape}, got {name} "
                         f"{tensor.dtype} {tuple(tensor.shape)}")


class SafetensorsWriter:
    """Writes one .safetensors file tensor by tensor, in the order the header was planned.

    Why not ``safetensors.torch.save_file``: it needs every tensor at once (a whole model in
    memory for consolidation) and refuses views that share storage (our flat-buffer slices).
    """

    def __init__(self, path: str | Path, specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        head, self._order = safetensors_header(specs, metadata)
        # never written through a symlink at the destination; closed in close()
        self._f = os.fdopen(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644), "wb")
        self._sha = hashlib.sha256()
        self._put(head)
        self._next = 0

    def _put(self, data: bytes | memoryview) -> None:
        self._f.write(data)
        self._sha.update(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor``; must be the next planned name, with the planned dtype and shape."""
        check_planned(self.path, self._order[self._next], name, tensor)
        t = tensor.detach().reshape(-1).contiguous().cpu()
        if t.numel():
            self._put(memoryview(t.view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> tuple[str, int]:
        """Flush to disk; returns (sha256 hex, size in bytes)."""
        if self._next != len(self._order):
            raise ValueError(f"{self.path.name}: {len(self._order) - self._next} planned tensors unwritten")
        self._f.flush()
        os.fsync(self._f.fileno())
        size = self._f.tell()
        self._f.close()
        return self._sha.hexdigest(), size


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with os.fdopen(open_regular(path, CheckpointError), "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class ShardReader:
    """Reads element ranges of saved tensors from a checkpoint folder, verifying files first.

    ``files`` is the validated metadata's file list; every name is confined to ``folder``, every
    file's size and sha256 are checked before its first use, and every tensor's safetensors header
    entry must have the dtype and shape the metadata promises, so no read is ever reinterpreted or
    cast. Any failure is a :class:`CheckpointError` naming the file.
    """

    def __init__(self, folder: Path, files: dict[str, dict], verify: bool = True):
        self.folder, self.files, self.verify = folder, files, verify
        self._verified: set[str] = set()
        self._open: dict[str, SafetensorsFile] = {}
        self._ahead: hash_ahead.Verifier | None = None

    def verify_ahead(self, fnames: Iterable[str]) -> None:
        """Check the sizes of ``fnames`` now and hash them on background threads (``hash_ahead.py``)
        while this thread reads; :meth:`wait_verified` must follow before anything read is used."""
        for fname in dict.fromkeys(fnames):
            if fname in self._verified:
                continue
            info, path = self.files.get(fname), self._path(fname)
            if info is None:
                raise CheckpointError(f"{path}: not listed in the checkpoint's metadata.json")
            self._check_size(path, info)
            if self.verify:
                if self._ahead is None:
                    self._ahead = hash_ahead.Verifier()
                self._ahead.start(path, info["bytes"], info["sha256"])
            self._verified.add(fname)

    def wait_verified(self) -> None:
        """Every hash started by :meth:`verify_ahead` done and equal to the metadata's (else the first
        mismatch, naming its file); no background thread is left."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.wait()

    @staticmethod
    def _check_size(path: Path, info: dict) -> None:
        if not path.is_file():
            raise CheckpointError(f"{path}: file is missing")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"{path}: file is truncated or was modified ({size} bytes, "
                                  f"metadata.json says {info['bytes']})")

    def _path(self, fname: str) -> Path:
        from shardwise.checkpoint.validate import confined_path

        return confined_path(self.folder, fname, self.folder / "metadata.json")

    def check(self, fname: str) -> None:
        """Refuse a file whose size or sha256 differs from the metadata, naming it."""
        if fname in self._verified:
            return
        info = self.files.get(fname)
        path = self._path(fname)
        if info is None:
            raise CheckpointError(f"{path}: not listed in the checkpoint's metadata.json")
        self._check_size(path, info)
        if self.verify and sha256_file(path) != info["sha256"]:
            raise CheckpointError(f"{path}: sha256 mismatch, the file is corrupt")
        self._verified.add(fname)

    def handle(self, fname: str) -> SafetensorsFile:
        """``fname`` opened (header validated) once its size and hash are verified."""
        if fname not in self._open:
            self.check(fname)
            try:
                self._open[fname] = SafetensorsFile(self._path(fname))
            except (OSError, ValueError) as e:  # a header the one reader refuses, naming the file
                raise CheckpointError(f"{self.folder / fname}: not a readable safetensors file: {e}") from e
        return self._open[fname]

    def _entry(self, fname: str, key: str, dtype: torch.dtype, shape: list[int]) -> SafetensorsFile:
        """The file holding ``key``, refused unless its header gives ``key`` ``dtype`` and ``shape``."""
        f = self.handle(fname)
        t = f.tensors.get(key)
        if t is None:
            raise CheckpointError(f"{self.folder / fname}: tensor {key} is not in the file")
        if t.dtype != dtype or list(t.shape) != list(shape):
            raise CheckpointError(f"{self.folder / fname}: tensor {key} is {ST_NAMES[t.dtype]} {list(t.shape)} in the "
                                  f"file, metadata.json says {dtype_name(dtype)} {list(shape)}")
        return f

    def read_range(self, key: str, segments: list[dict], lo: int, hi: int, out: torch.Tensor,
                   stored: torch.dtype | None = None) -> None:
        """Fill ``out`` (1-D, hi - lo elements) with elements [lo, hi) of ``key`` from its segments.
        ``stored``: the dtype metadata.json promises for ``key`` when ``out`` is another float dtype (a
        bf16 master loaded into fp32 masters and back: the header is still checked, the read converts)."""
        covered = 0
        for seg in segments:
            a, b = max(lo, seg["start"]), min(hi, seg["stop"])
            if a >= b:
                continue
            f = self._entry(seg["file"], key, stored or out.dtype, [seg["stop"] - seg["start"]])
            i, j, dst = a - seg["start"], b - seg["start"], out.narrow(0, a - lo, b - a)
            self._get(seg["file"], key, lambda f=f, i=i, j=j, dst=dst: f.read(key, i, j, dst))
            covered += b - a
        if covered != hi - lo:
            raise CheckpointError(f"{self.folder}: {key} elements [{lo}, {hi}) are not all in the checkpoint")

    def read_full(self, key: str, fname: str, dtype: torch.dtype, shape: list[int],
                  stored: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor ``key`` in ``dtype`` (``stored``: the promised file dtype, as in read_range)."""
        f = self._entry(fname, key, stored or dtype, shape)
        return self._get(fname, key, lambda: f.read_tensor(key)).to(dtype)

    def _get(self, fname: str, key: str, read):
        try:
            return read()
        except (OSError, ValueError) as e:  # a file cut short after it was verified
            raise CheckpointError(f"{self.folder / fname}: cannot read tensor {key}: {e}") from e

    def release(self) -> None:
        """Close the open files (nothing is mapped: reads are ``pread`` into the caller's tensors)."""
        for f in self._open.values():
            f.close()
        self._open.clear()


# -- JSON helpers -------------------------------------------------------------------------------
def to_json(obj: Any, path: str) -> Any:
    """Plain-JSON copy of ``obj`` (tensors of one element become numbers, tuples lists); else error."""
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if torch.is_tensor(obj) and obj.numel() == 1:
        return obj.item()
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{path} has a non-string key {k!r}: checkpoints store JSON only")
            out[k] = to_json(v, f"{path}[{k!r}]")
        return out
    if isinstance(obj, list | tuple):
        return [to_json(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    raise TypeError(f"{path} is a {type(obj).__name__}, which is not JSON-serializable; checkpoints "
                    "store JSON only (no pickle): convert it to numbers, strings, lists and dicts")


def like(current: Any, saved: Any) -> Any:
    """Saved JSON value restored to the live value's type (tuple, tensor)."""
    if torch.is_tensor(current):
        return torch.tensor(saved, dtype=current.dtype, device=current.device)
    if isinstance(current, tuple):
        return tuple(saved)
    return saved


def write_json(path: Path, obj: Any) -> None:
    """Strict JSON (a NaN/infinity is refused naming its key), written to a temporary name, fsynced
    and renamed: every shardwise reader refuses non-finite numbers, so they are refused at save."""
    finite_json(obj, path.name)
    write_atomic(path, json.dumps(obj, indent=1, allow_nan=False).encode())


# -- RNG states (JSON) --------------------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8)


def rng_state() -> dict:
    """This rank's RNG states (torch, CUDA, Python, NumPy) as JSON."""
    import numpy as np

    v, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"torch": _b64(torch.get_rng_state()), "python": [v, list(state), gauss],
           "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    if torch.cuda.is_available():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def rng_setter(s: dict, source: Path) -> Callable[[], None]:
    """Decode the saved RNG states ``s`` and try them on scratch generators now; returns the
    function that installs them, which then cannot fail (loads are all-or-nothing)."""
    import numpy as np

    try:
        cpu = _unb64(s["torch"])
        torch.Generator().set_state(cpu)
        v, state, gauss = s["python"]
        py = (v, tuple(state), gauss)
        random.Random().setstate(py)
        kind, keys, pos, has_gauss, cached = s["numpy"]
        npst = (kind, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, cached)
        if np.asarray(keys, dtype=np.int64).min(initial=0) < 0:
            raise ValueError("negative numpy key")
        np.random.RandomState().set_state(npst)
        cuda = [_unb64(x) for x in s.get("cuda", [])]
    except Exception as e:  # noqa: BLE001 - any malformed piece: KeyError, ValueError, TypeError, ...
        raise CheckpointError(f"{source}: unusable RNG state ({type(e).__name__}: {e})"[:400]) from e

    def apply() -> None:
        torch.set_rng_state(cpu)
        random.setstate(py)
        np.random.set_state(npst)
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)

    return apply


# -- cross-rank agreement -----------------------------------------------------------------------
def world_comm() -> Comm:
    """All ranks (dp x tp), with its own byte counter so checkpoint traffic stays out of comm_stats
    (the checkpoint code's name for ``make_comm("world")``)."""
    return make_comm("world", CommStats())


def agree(comm: Comm, err: BaseException | None, what: str) -> None:
    """Every rank learns whether any rank failed ``what``; then all raise the same CheckpointError.

    The message is the failure of the lowest failing rank (its file named), broadcast so that
    every rank reports the real cause rather than a peer's collective error.

    Without this a rank that failed alone (a bad file, a full disk) would leave its peers
    blocked in the next collective until the timeout.
    """
    if comm.size == 1:
        if err is not None:
            raise err
        return
    # on the collectives' device (NCCL takes no host tensor); read on the host: a decision every rank makes
    flag = torch.tensor([comm.rank if err is not None else comm.size], dtype=torch.int64, device=compute_device())
    comm.all_reduce(flag, op=dist.ReduceOp.MIN)
    src = int(flag.item())
    if src == comm.size:
        return
    buf = torch.zeros(4096, dtype=torch.uint8, device=compute_device())
    if comm.rank == src:
        msg = f"{type(err).__name__}: {err}".encode()[:4096]
        buf[: len(msg)] = torch.frombuffer(bytearray(msg), dtype=torch.uint8).to(buf.device)
    comm.broadcast(buf, src=src)
    text = bytes(buf.cpu().numpy()).rstrip(b"\0").decode(errors="replace")
    if err is not None and not isinstance(err, Exception):
        raise err  # KeyboardInterrupt, SystemExit: not a checkpoint problem
    raise CheckpointError(f"{what} failed on rank {src}: {text}") from err  # the same text on every rank
