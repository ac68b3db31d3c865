"""Hugging Face ``datasets`` as ``shardwise train --data``: a ``save_to_disk`` folder, ``.parquet`` /
``.arrow`` files (or a folder holding only those), or a hub name already in the local cache.

Nothing is downloaded: a hub name is loaded with the datasets library offline, so only a dataset
fetched before (``datasets.load_dataset(name)`` once, on a machine with network) is found. The split
is ``train`` (or the only one); ``--text-key`` names the column (default ``text``).

How it joins the run: global rank 0 writes the column once to ``RUN/data/hf-<key>.jsonl`` (the key
hashes what was loaded: its Arrow cache files' names, sizes and times, or the files given) and
the usual pipeline tokenizes that JSONL file (``train/data.py``), so the token cache, packing,
held-out split and resume-exact order are the same as for any other data. The copy costs one pass
over the text on disk; rows stream, so memory stays bounded by a batch of rows.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardwise.files.safe import commit_temp, open_temp
from shardwise.train.data import DataError

ARROW_FILES = (".parquet", ".arrow")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _data_files(p: Path) -> list[Path]:
    if p.is_file():
        return [p] if p.suffix in ARROW_FILES else []
    if p.is_dir() and not (p / "state.json").is_file() and not (p / "dataset_dict.json").is_file():
        files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
        return files if files and all(f.suffix in ARROW_FILES for f in files) else []
    return []


def dataset_kind(data: str) -> str | None:
    """'disk' (save_to_disk folder), 'files' (parquet/arrow), 'hub' (a name, no such path), or None
    when --data is text or JSONL for the usual readers."""
    p = Path(data)
    if p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()):
        return "disk"
    if _data_files(p):
        return "files"
    if not p.exists() and _HUB_NAME.match(data) and p.suffix not in (".txt", ".jsonl", ".json"):
        return "hub"
    return None


def _one_split(ds: Any, data: str) -> Any:
    """The ``train`` split of a DatasetDict (or its only split); a Dataset as it is."""
    if not hasattr(ds, "keys"):
        return ds
    splits = list(ds.keys())
    if "train" in splits:
        return ds["train"]
    if len(splits) == 1:
        return ds[splits[0]]
    raise DataError(f"--data {data}: the dataset has splits {splits} and none is 'train'; save the split to "
                    "train on alone (dataset[split].save_to_disk(folder))")


def _load(data: str, kind: str, cache_dir: Path) -> Any:
    """The dataset, offline; every failure one DataError naming --data."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read when datasets is first imported
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise DataError(f"--data {data}: a Hugging Face dataset needs the datasets package "
                        "(pip install 'shardwise[hf]')") from None
    try:
        with _offline(datasets):
            return _load_offline(datasets, data, kind, cache_dir)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many types; the user needs one line
        hint = (" (no such file or folder, and no dataset of that name in the local cache: shardwise downloads "
                "nothing; run datasets.load_dataset(name) once where there is network, or pass a save_to_disk "
                "folder)") if kind == "hub" else ""
        raise DataError(f"--data {data}: cannot load it as a Hugging Face dataset: {type(e).__name__}: "
                        f"{str(e)[:200]}{hint}") from None


@contextlib.contextmanager
def _offline(datasets: Any) -> Iterator[None]:
    """Offline mode for this load, also where datasets and huggingface_hub were imported before (their
    flags are read at import): otherwise a hub name not in the cache is looked up over the network,
    with five retries (23 s on a machine without network) before the same error. Restored after."""
    import huggingface_hub.constants as hub

    saved = hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE
    hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = saved


def _load_offline(datasets: Any, data: str, kind: str, cache_dir: Path) -> Any:
    """A save_to_disk folder, parquet/arrow files (one split, 'train'), or a hub name from the cache."""
    if kind == "disk":
        return _one_split(datasets.load_from_disk(data), data)
    if kind == "files":
        files = [str(f) for f in _data_files(Path(data))]
        builder = "parquet" if files[0].endswith(".parquet") else "arrow"
        return datasets.load_dataset(builder, data_files=files, split="train", cache_dir=str(cache_dir / "hf"))
    return _one_split(datasets.load_dataset(data), data)


def _key(ds: Any, data: str, text_key: str) -> str:
    h = hashlib.sha256(f"{data}\0{text_key}\0{len(ds)}".encode())
    for f in sorted(c["filename"] for c in ds.cache_files):
        st = os.stat(f)
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:16]


def dataset_to_jsonl(data: str, text_key: str, cache_dir: Path) -> Path:
    """Write (or reuse) the ``text_key`` column of the dataset ``data`` as JSONL; returns its path."""
    kind = dataset_kind(data)
    if kind is None:
        raise DataError(f"--data {data}: not a Hugging Face dataset")
    ds = _load(data, kind, cache_dir)
    if text_key not in ds.column_names:
        raise DataError(f"--data {data}: no column '{text_key}' (columns: {', '.join(ds.column_names)}); "
                        "pass --text-key COLUMN")
    out = cache_dir / f"hf-{_key(ds, data, text_key)}.jsonl"
    if out.is_file():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    row = 0
    with open_temp(out) as f:
        for batch in ds.select_columns([text_key]).iter(batch_size=1000):
            for text in batch[text_key]:
                if not isinstance(text, str):
                    raise DataError(f"--data {data}: row {row} of column '{text_key}' is "
                                    f"{type(text).__name__}, not text; choose a text column with --text-key")
                f.write(json.dumps({text_key: text}).encode() + b"\n")
                row += 1
        f.flush()
        os.fsync(f.fileno())
    commit_temp(out)
    return out
