"""What ``consolidate`` finds around a checkpoint: the run's checkpoints folder, and the files beside
an HF model's weights that make it usable (tokenizer and generation config).

``from_pretrained`` loads weights from ``config.json`` and ``model*.safetensors`` alone, but
``generate`` also needs the tokenizer the model was trained with and its generation defaults.
``shardwise train`` keeps them in the run folder (``RUN/tokenizer/``, written at the start, so a
run stopped early has them too); ``consolidate`` copies them next to the weights it writes, from
the first of: the checkpoint's tag folder (an HF Trainer ``checkpoint-N/`` holds them), the
checkpoint folder itself, the run folder's ``tokenizer/`` (when the checkpoint folder is a run's
``checkpoints/``).
"""

from __future__ import annotations

import os
from pathlib import Path

from shardwise.checkpoint.fileio import CheckpointError
from shardwise.files.safe import hub_roots, read_in, write_atomic

RUN_TOKENIZER = "tokenizer"  # RUN/tokenizer/: the run's tokenizer and generation config
_NAMES = {"generation_config.json", "special_tokens_map.json", "added_tokens.json", "merges.txt",
          "chat_template.jinja", "chat_template.json", "preprocessor_config.json"}
_PREFIXES = ("tokenizer", "vocab", "spiece", "sentencepiece")


def is_side_file(name: str) -> bool:
    """A tokenizer or generation-config file name (``tokenizer.json``, ``vocab.txt``, ``merges.txt``...)."""
    return not name.startswith(".") and (name in _NAMES or name.startswith(_PREFIXES))


def side_files_in(folder: str | os.PathLike) -> list[str]:
    """The side files at the top of ``folder`` (regular files only), sorted."""
    p = Path(folder)
    if not p.is_dir():
        return []
    return sorted(n for n in os.listdir(p) if is_side_file(n) and (p / n).is_file() and not (p / n).is_symlink())


def find_side_files(ckpt_dir: str | os.PathLike, tag_path: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """Where a checkpoint's tokenizer lives, and its file names; ``(None, [])`` when nowhere."""
    root = Path(ckpt_dir)
    candidates = [Path(tag_path), root]
    if (root.parent / "run_config.json").is_file():  # a `shardwise train` run's checkpoints/
        candidates.append(root.parent / RUN_TOKENIZER)
    for folder in candidates:
        names = side_files_in(folder)
        if any(n.startswith("tokenizer") or n.startswith("vocab") for n in names):
            return folder, names
    return None, []


def copy_side_files(src: str | os.PathLike, names: list[str], dst: str | os.PathLike) -> list[str]:
    """Copy ``names`` from ``src`` to ``dst`` (each confined to ``src``, read as a regular file)."""
    for name in names:
        write_atomic(Path(dst) / name, read_in(src, name, also=hub_roots(src)))
    return list(names)


def checkpoints_folder(ckpt_dir: str | os.PathLike, tag: str | None) -> Path:
    """``ckpt_dir``, or its ``checkpoints/`` when it is a run folder (no ``latest`` of its own).

    Refused in one line naming the folder to pass when neither holds a ``latest`` file and no
    ``tag`` is given (a DCP or DeepSpeed tag folder given directly is left to the reader)."""
    root = Path(ckpt_dir)
    if tag is not None or (root / "latest").exists():
        return root
    inner = root / "checkpoints"
    if (inner / "latest").is_file():
        return inner
    if (root / "run_config.json").is_file():
        raise CheckpointError(f"{root}: this run saved no checkpoint yet ({inner} holds no 'latest' file); "
                              "train it with --save-every, or until it ends")
    return root
