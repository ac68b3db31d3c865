"""Compatibility names for the benchmarks: the main job itself lives in :mod:`shardwise.train`.

``build_model(preset, seq, seed)`` and ``ByteTextDataset`` keep the byte-level presets the
benchmarks train (``benchmarks/zero/bench_zero.py``), built exactly as before.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

from shardwise.cli.train import main
from shardwise.train.model import ModelSource
from shardwise.train.model import build_model as _build
from shardwise.train.presets import MODEL_PRESETS, REPO_DATA

__all__ = ["MODEL_PRESETS", "REPO_DATA", "ByteTextDataset", "build_model", "main"]


class ByteTextDataset(Dataset):
    """Fixed-length windows (stride seq/2) of a text's UTF-8 bytes (vocabulary 256)."""

    def __init__(self, path: Path, seq_len: int):
        data = torch.tensor(list(path.read_bytes()), dtype=torch.long)
        if (len(data) - 1) // seq_len < 1:
            raise ValueError(f"{path} is shorter than one sequence of {seq_len} bytes (--seq)")
        stride = max(1, seq_len // 2)
        self.samples = [data[s:s + seq_len] for s in range(0, len(data) - seq_len - 1, stride)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.samples[i], "labels": self.samples[i]}


def build_model(preset: str, seq_len: int, seed: int) -> torch.nn.Module:
    """A byte-level preset Llama (the benchmarks' model), seeded."""
    if preset not in MODEL_PRESETS:
        raise ValueError(f"--model {preset!r} is unknown; choose one of {sorted(MODEL_PRESETS)}")
    return _build(ModelSource("preset", preset), 256, seq_len, seed, stage=0)
