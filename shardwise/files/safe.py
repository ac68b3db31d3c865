"""The one rule for files shardwise reads from, and writes into, folders the user gave it.

Reading. A checkpoint, model or data folder is input that may be damaged or hostile. A name read
from it (a shard list, ``latest``, an index ``weight_map``, a tag) or one shardwise looks for
(``config.json``, ``metadata.json``, tokenizer files) is confined with :func:`confine`: no NUL,
backslash, absolute path or ``..``, and the path *as resolved* (every symlink followed) must lie
inside the folder. The file is then opened with :func:`open_regular`: ``O_NONBLOCK`` (a FIFO or
device never blocks the open) and ``fstat`` must say it is a regular file, else it is refused by
name. A Hugging Face hub cache snapshot (``.../snapshots/REV/``) may link into its own
``.../blobs/`` folder (:func:`hub_roots`), which is how the hub stores every file.

Writing. :class:`OutputFolder` guards a command's output folder: an existing file in its place, an
output that resolves into one of the inputs, and a folder holding files shardwise did not write
are refused (the last unless ``overwrite``); what a command writes is recorded in
``.shardwise-outputs.json`` so a rerun replaces only its own files. Files are written to a hidden
temporary name (``O_EXCL | O_NOFOLLOW``) and renamed into place, so a symlink at the destination
is replaced, never written through, and a crash leaves no half file under the final name.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from shardwise.errors import CheckpointError, UserError

MANIFEST = ".shardwise-outputs.json"
ErrorType = type[Exception]
MAX_JSON = 1 << 30  # a larger JSON file in a checkpoint or model folder is damage


def plain_name(name: object) -> bool:
    """A name that can be a folder or file name and read back as written: printable, no slash or
    backslash, no spaces or newlines at either end, not hidden, not '.' or '..'."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and name.isprintable() and name == name.strip()
            and "/" not in name and "\\" not in name and not name.startswith("."))


def finite_json(value: object, where: str) -> object:
    """``value`` unchanged, refused (naming the key) if it holds a NaN or infinity: strict JSON, which
    every shardwise reader requires, cannot hold them."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} is {value}, which JSON cannot hold (checkpoints are strict JSON); "
                         "store a finite number or a string")
    if isinstance(value, dict):
        for k, v in value.items():
            finite_json(v, f"{where}[{k!r}]")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            finite_json(v, f"{where}[{i}]")
    return value


def hub_roots(folder: str | os.PathLike) -> tuple[Path, ...]:
    """Extra roots a folder's symlinks may lead to: a hub snapshot's own ``blobs`` folder."""
    p = Path(folder).resolve()
    if p.parent.name == "snapshots" and (p.parent.parent / "blobs").is_dir():
        return (p.parent.parent / "blobs",)
    return ()


def _inside(path: Path, roots: Iterable[Path]) -> bool:
    return any(path != r and path.is_relative_to(r) for r in roots)


def confine(folder: str | os.PathLike, name: object, source: str | os.PathLike | None = None,
            error: ErrorType = UserError, also: Iterable[Path] = ()) -> Path:
    """``folder/name`` resolved, refused unless it (and every symlink on the way) stays in ``folder``.

    ``name`` came from ``source`` (named in the error; default the folder). ``also``: further roots
    the resolved path may lie in (:func:`hub_roots`).
    """
    where = source if source is not None else folder
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise error(f"{where}: {name!r} is not a plain relative file name")
    pure = PurePosixPath(name)
    if pure.is_absolute() or PureWindowsPath(name).is_absolute() or ".." in pure.parts:
        raise error(f"{where}: path {name!r} leads outside {folder} (absolute or '..'); refused")
    root = Path(folder).resolve()
    full = (root / pure).resolve()
    if not _inside(full, (root, *also)):
        raise error(f"{where}: path {name!r} resolves to {full}, outside {root} (a symlink out of the "
                    "folder?); refused")
    return full


def open_regular(path: str | os.PathLike, error: ErrorType = UserError, nofollow: bool = False) -> int:
    """A read-only descriptor of ``path``, refused (by name) unless it is a regular file.

    ``O_NONBLOCK`` keeps a FIFO from blocking the open; the check is on the opened descriptor
    (``fstat``), so the file cannot be swapped between check and use. ``nofollow``: refuse a
    symlink in the last component (for paths :func:`confine` already resolved).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if nofollow else 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise error(f"{path}: file is missing") from None
    except OSError as e:
        raise error(f"{path}: cannot open ({e.strerror}; a symlink swapped in?)") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{path}: not a regular file ({_kind(mode)}); refused")
    os.set_blocking(fd, True)
    return fd


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a plain file"


def read_regular(path: str | os.PathLike, limit: int = 1 << 30, error: ErrorType = UserError,
                 nofollow: bool = False) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``, else refused)."""
    fd = open_regular(path, error, nofollow)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise error(f"{path}: {size:,} bytes, more than the {limit:,} a file of this kind may have")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit + 1)[:limit]
    finally:
        os.close(fd)


def read_in(folder: str | os.PathLike, name: str, source: str | os.PathLike | None = None,
            error: ErrorType = UserError, limit: int = 1 << 30, also: Iterable[Path] = ()) -> bytes:
    """``folder/name`` confined (:func:`confine`) and read as a regular file."""
    return read_regular(confine(folder, name, source, error, also), limit, error, nofollow=True)


def check_folder(folder: str | os.PathLike, error: ErrorType = UserError,
                 wanted: Callable[[str], bool] = lambda name: True) -> None:
    """Every top-level entry of ``folder`` that ``wanted`` selects must be a regular file inside it.

    For folders a library reads by itself (transformers reads ``config.json``, tokenizer files and
    weights of a model folder): checked here first, each refusal naming the file.
    """
    root = Path(folder)
    also = hub_roots(root)
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name.startswith(".") or not wanted(entry.name) or entry.is_dir(follow_symlinks=False):
            continue
        full = confine(root, entry.name, root, error, also)
        os.close(open_regular(full, error, nofollow=True))


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a hidden temporary file next to ``path``, fsync, rename over ``path``."""
    final = Path(path)
    with open_temp(final) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp_of(final), final)


def temp_of(final: Path) -> Path:
    return final.parent / f".{final.name}.tmp"


def open_temp(final: Path):
    """The temporary file for ``final``, created afresh (``O_EXCL | O_NOFOLLOW``): binary, writable."""
    tmp = temp_of(final)
    if tmp.is_symlink() or tmp.is_file():
        tmp.unlink()  # left by a crash (ours: hidden and named after one of our outputs)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    return os.fdopen(fd, "wb")


def commit_temp(final: Path) -> None:
    """Rename the (already fsynced) temporary file of ``final`` into place."""
    os.replace(temp_of(final), final)


class OutputFolder:
    """A command's output folder: checked before any work, our files tracked in :data:`MANIFEST`.

    ``ours(name)`` says which names this command writes (e.g. ``model*.safetensors``). Refused: an
    existing non-folder at ``out``, ``out`` equal to or inside an input (resolved), and existing
    entries not recorded as ours unless ``overwrite`` (then only names ``ours`` selects are
    replaced; other files are left alone).
    """

    def __init__(self, out: str | os.PathLike, flag: str, inputs: Iterable[str | os.PathLike] = (),
                 overwrite: bool = False, ours: Callable[[str], bool] = lambda name: False):
        self.out, self.flag, self.overwrite, self.ours = Path(out), flag, overwrite, ours
        if self.out.is_symlink() and not self.out.exists():
            raise UserError(f"{flag} {out}: a dangling symlink; remove it or choose another folder")
        if self.out.exists() and not self.out.is_dir():
            raise UserError(f"{flag} {out}: an existing file, not a folder; choose a folder name")
        resolved = self.out.resolve()
        for src in inputs:
            root = Path(src).resolve()
            if resolved == root or (root.is_dir() and resolved.is_relative_to(root)):
                raise UserError(f"{flag} {out}: resolves to {resolved}, inside the input {src}; write "
                                "the output somewhere else")
        self.recorded = self._read_manifest()
        foreign = [n for n in self._entries() if n not in self.recorded and n != MANIFEST
                   and not n.startswith(".")]
        if foreign and not overwrite:
            raise UserError(f"{flag} {out}: the folder already holds files shardwise did not write "
                            f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); choose an "
                            "empty folder, or pass --overwrite to replace shardwise's outputs there")

    def _entries(self) -> list[str]:
        return sorted(os.listdir(self.out)) if self.out.is_dir() else []

    def _read_manifest(self) -> set[str]:
        if not (self.out / MANIFEST).exists() and not (self.out / MANIFEST).is_symlink():
            return set()
        try:
            names = json.loads(read_in(self.out, MANIFEST))
        except (UserError, ValueError):
            raise UserError(f"{self.out / MANIFEST}: damaged (not a JSON list of file names); remove it "
                            "to start the folder afresh") from None
        if not isinstance(names, list) or not all(isinstance(n, str) and "/" not in n for n in names):
            raise UserError(f"{self.out / MANIFEST}: not a JSON list of file names")
        return set(names)

    def prepare(self) -> Path:
        """Create the folder (the checks were done at construction); returns it."""
        self.out.mkdir(parents=True, exist_ok=True)
        return self.out

    def finish(self, written: Iterable[str]) -> None:
        """Record ``written`` as ours and remove our stale outputs (recorded earlier, or, with
        ``overwrite``, names ``ours`` selects) that would shadow them (old weight shards)."""
        written = set(written)
        for name in self._entries():
            stale = name in self.recorded or (self.overwrite and self.ours(name))
            if stale and name not in written and name != MANIFEST and not name.startswith("."):
                p = self.out / name
                if p.is_symlink() or p.is_file():
                    p.unlink()
        write_atomic(self.out / MANIFEST, json.dumps(sorted(written), indent=1).encode())


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def read_json(path: Path) -> Any:
    """Strict JSON (no NaN/Infinity, UTF-8), or a CheckpointError naming ``path``."""
    if not os.path.lexists(path):
        raise CheckpointError(f"{path}: file is missing")
    raw = read_regular(path, MAX_JSON, CheckpointError)  # a FIFO or folder is refused, never blocks
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: not valid JSON (truncated or corrupt): {e}"[:500]) from e
