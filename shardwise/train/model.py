"""The model and tokenizer of a run: a preset, a local HF folder, or a config.json (from scratch).

Nothing is downloaded: presets and config files build a fresh model from a config, HF folders are
read with ``local_files_only``. At ZeRO stage 3 the model is built under ``shardwise.zero.Init``,
so each rank materializes (or reads from the folder's safetensors) only its own slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.files.model_folder import check_model_folder, loading, parse_model_config, refuse_missing
from shardwise.files.safe import read_regular
from shardwise.train.presets import MODEL_PRESETS

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ModelError(ValueError):
    """A --model that cannot be used; the message names the path or preset and the fix."""


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256): needs no tokenizer files and no download."""

    name = "bytes"
    vocab_size = 256
    eos_token_id: int | None = None
    splits_anywhere = True  # text may be encoded in chunks cut anywhere (train/tokenize_stream.py)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """An HF tokenizer read from the model folder (local files only)."""

    def __init__(self, folder: Path):
        from transformers import AutoTokenizer

        with loading(folder, "tokenizer"):
            self.tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.name = f"hf:{folder.resolve()}"
        self.vocab_size = len(self.tok)
        self.eos_token_id = self.tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


@dataclass
class ModelSource:
    """What --model names: kind is 'preset', 'pretrained' (weights in a folder) or 'config'."""

    kind: str
    spec: str
    path: Path | None = None

    @property
    def folder(self) -> Path | None:
        if self.path is None:
            return None
        return self.path if self.path.is_dir() else self.path.parent


def resolve_model(spec: str) -> ModelSource:
    """Classify --model; raises ModelError naming the value and what it accepts."""
    if spec in MODEL_PRESETS:
        return ModelSource("preset", spec)
    p = Path(spec)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelError(f"--model {spec}: the folder has no config.json; give an HF model folder, a "
                             f"config.json or a preset ({', '.join(MODEL_PRESETS)})")
        check_model_folder(p)  # every file a regular one inside the folder; config.json sane
        has_weights = any((p / f).is_file() for f in WEIGHT_FILES)
        return ModelSource("pretrained" if has_weights else "config", spec, p)
    if p.is_file() and p.suffix == ".json":
        return ModelSource("config", spec, p)
    raise ModelError(f"--model {spec!r} is not a preset ({', '.join(MODEL_PRESETS)}), an HF model folder "
                     "or a config.json file (Hub names are not downloaded: download the folder first, e.g. "
                     f"`hf download {spec} --local-dir DIR`, and pass --model DIR)")


def load_tokenizer(src: ModelSource) -> ByteTokenizer | HFTokenizer:
    """The folder's tokenizer when it ships one, else byte-level."""
    folder = src.folder
    if folder is not None and any((folder / f).is_file() for f in TOKENIZER_FILES):
        return HFTokenizer(folder)
    return ByteTokenizer()


def _config_from_json(path: Path) -> Any:
    from transformers import AutoConfig

    d = parse_model_config(read_regular(path, 64 << 20), path)
    d = {k: v for k, v in d.items() if k not in ("architectures", "transformers_version")}
    with loading(path, "config"):
        return AutoConfig.for_model(d.pop("model_type"), **d)


def build_model(src: ModelSource, vocab_size: int, seq: int, seed: int, stage: int) -> nn.Module:
    """The model for ``src``, its vocabulary and positions checked against the data; seeded init."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import shardwise

    torch.manual_seed(seed)
    if src.kind == "preset":
        cfg = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=max(seq, 256), tie_word_embeddings=False,
                          **MODEL_PRESETS[src.spec])
    else:
        cfg = _config_from_json(src.path / "config.json" if src.path.is_dir() else src.path)
    model_vocab = getattr(cfg, "vocab_size", None)
    if model_vocab is not None and model_vocab < vocab_size:
        raise ModelError(f"--model {src.spec}: vocab_size {model_vocab} is smaller than the tokenizer's "
                         f"{vocab_size}; use a config with vocab_size >= {vocab_size}")
    positions = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if positions is not None and seq > positions:
        raise ModelError(f"--seq {seq} exceeds the model's max_position_embeddings {positions}; "
                         f"use --seq <= {positions}")
    with shardwise.zero.Init(enabled=stage == 3):
        with loading(src.path or src.spec):
            if src.kind == "pretrained":
                model = AutoModelForCausalLM.from_pretrained(str(src.path), config=cfg, local_files_only=True,
                                                             output_loading_info=True)
            else:
                model = AutoModelForCausalLM.from_config(cfg)
    if isinstance(model, tuple):  # zero.Init's from_pretrained reads the weights later, by itself
        model, info = model
        refuse_missing(info, src.path)
    model.train()
    return model


def n_params(model: nn.Module) -> int:
    """Parameter count before ZeRO or TP cut the model (meta parameters count too)."""
    return sum(p.numel() for p in model.parameters())
