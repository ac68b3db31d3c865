"""`shardwise train --data` from Hugging Face datasets: a save_to_disk folder, parquet and arrow files;
the texts reach the token file exactly as the same texts in JSONL would; errors name the fix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rank_pool import RankPool
from train_cases import train_in

from shardwise.train.data import DataError, list_sources, tokenize_to_cache
from shardwise.train.hf_datasets import dataset_kind, dataset_to_jsonl
from shardwise.train.model import ByteTokenizer

datasets = pytest.importorskip("datasets")
ROOT = Path(__file__).resolve().parent.parent
TEXTS = [f"document {i}: " + "Shall I compare thee to a summer's day? " * (1 + i % 3) for i in range(40)] + ["é 😀"]


def _tokens(meta: Path) -> list[int]:
    m = json.loads(meta.read_text())
    return np.fromfile(meta.parent / m["file"], dtype=m["dtype"]).tolist()


def _want(tmp: Path) -> list[int]:
    """The same texts as a JSONL file, through the usual reader."""
    f = tmp / "want.jsonl"
    f.write_text("".join(json.dumps({"content": t}) + "\n" for t in TEXTS))
    return _tokens(tokenize_to_cache([f], ByteTokenizer(), tmp / "want_cache", "content"))


def _got(data: Path, tmp: Path) -> list[int]:
    jsonl = dataset_to_jsonl(str(data), "content", tmp / "run_data")
    assert dataset_to_jsonl(str(data), "content", tmp / "run_data") == jsonl  # written once, then reused
    return _tokens(tokenize_to_cache(list_sources(jsonl), ByteTokenizer(), tmp / "run_data", "content"))


def _dataset():
    return datasets.Dataset.from_dict({"content": TEXTS, "label": list(range(len(TEXTS)))})


def test_save_to_disk_folder(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    datasets.DatasetDict({"train": _dataset(), "test": _dataset().select(range(3))}).save_to_disk(str(folder))
    assert dataset_kind(str(folder)) == "disk"
    assert _got(folder, tmp_path) == _want(tmp_path)


def test_parquet_and_arrow_files(tmp_path: Path) -> None:
    _dataset().to_parquet(str(tmp_path / "part.parquet"))
    assert dataset_kind(str(tmp_path / "part.parquet")) == "files"
    assert _got(tmp_path / "part.parquet", tmp_path) == _want(tmp_path)
    arrow = tmp_path / "arrow_folder"
    _dataset().save_to_disk(str(tmp_path / "saved"))
    arrow.mkdir()
    for f in (tmp_path / "saved").glob("*.arrow"):
        (arrow / f.name).write_bytes(f.read_bytes())
    assert dataset_kind(str(arrow)) == "files"
    assert _got(arrow, tmp_path / "a") == _want(tmp_path / "a")


def test_text_and_jsonl_stay_with_the_usual_readers(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x")
    assert dataset_kind(str(tmp_path / "a.txt")) is None and dataset_kind(str(tmp_path)) is None
    assert dataset_kind(str(ROOT / "data" / "sonnets.txt")) is None


def test_errors_name_the_fix(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    _dataset().save_to_disk(str(folder))
    with pytest.raises(DataError, match=r"no column 'text' \(columns: content, label\); pass --text-key"):
        dataset_to_jsonl(str(folder), "text", tmp_path / "c")
    with pytest.raises(DataError, match="row 0 of column 'label' is int"):
        dataset_to_jsonl(str(folder), "label", tmp_path / "c")
    with pytest.raises(DataError, match="local cache: shardwise downloads nothing"):
        dataset_to_jsonl("no-such-user/no-such-dataset-38", "text", tmp_path / "c")


def test_a_hub_name_is_looked_up_offline_after_datasets_was_imported(tmp_path: Path, monkeypatch) -> None:
    """datasets and huggingface_hub read their offline flags at import; imported before (as here: this
    file imports datasets), a hub name not in the cache would be asked of the network, five retries
    (23 s without network), before the same error. No request is made; the flags are restored after."""
    import datasets
    import huggingface_hub.constants as hub
    from huggingface_hub import file_download

    def no_network(*args, **kwargs):
        raise AssertionError(f"a network request: {args[:1]}")

    monkeypatch.setattr(file_download, "get_hf_file_metadata", no_network)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with pytest.raises(DataError, match="local cache: shardwise downloads nothing") as e:
        dataset_to_jsonl("no-such-user/no-such-dataset-39", "text", tmp_path / "c")
    assert "network request" not in str(e.value)
    assert hub.HF_HUB_OFFLINE is False and datasets.config.HF_HUB_OFFLINE is False


def test_train_cli_on_a_saved_dataset(tmp_path: Path, pool1: RankPool) -> None:
    """`shardwise train --data SAVED_DATASET` through the CLI's entry, in a one-rank pool (train_cases.py)."""
    folder = tmp_path / "ds"
    _dataset().save_to_disk(str(folder))
    out = tmp_path / "run"
    log = train_in(pool1, ["--model", "llama-micro", "--data", str(folder), "--text-key", "content", "--seq", "32",
                           "--steps", "2", "--sample-tokens", "0", "--no-export", "--out", str(out)])
    assert "final eval loss" in log
    assert list((out / "data").glob("hf-*.jsonl"))
