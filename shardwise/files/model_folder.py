"""A Hugging Face model folder given to ``generate``, ``quantize``, ``train --model`` or ``init_inference``.

transformers reads the folder by itself (``config.json``, tokenizer files, weights), following
symlinks and blocking on a FIFO, and rejects a damaged folder with whatever its code raises
(``JSONDecodeError``, ``KeyError``, ``OSError``, ``SafetensorError``, a tokenizers exception).
So before transformers sees a folder, :func:`check_model_folder` applies the one file rule
(``files.safe``: every top-level file a regular file inside the folder or its hub ``blobs``) and
checks ``config.json`` itself (strict JSON object, a ``model_type`` string, positive sizes); and
:func:`loading` turns what transformers raises on the folder into one :class:`UserError` naming
it. A folder missing a weight the model needs is refused (:func:`refuse_missing`) instead of
leaving that weight at its random init.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from shardwise.errors import CheckpointError, UserError
from shardwise.files.safe import check_folder, confine, hub_roots, read_in, read_json
from shardwise.files.safetensors_io import SafetensorsFile

# config keys that count something: a zero, negative or non-integer value cannot build a model
SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "vocab_size", "max_position_embeddings", "n_embd", "n_layer", "n_head",
             "n_positions", "n_inner", "head_dim")
MAX_SIZE = 1 << 24


def read_model_config(folder: str | os.PathLike, flag: str = "--model") -> dict:
    """``folder/config.json`` confined and parsed (:func:`parse_model_config`)."""
    path = Path(folder) / "config.json"
    return parse_model_config(read_in(folder, "config.json", path, limit=64 << 20, also=hub_roots(folder)),
                              path, flag)


def parse_model_config(raw: bytes, path: Path, flag: str = "--model") -> dict:
    """The bytes of a config.json as a dict, refused in one line unless they can build a model."""
    try:
        cfg = json.loads(raw.decode("utf-8"), parse_constant=lambda c: _bad_constant(path, c))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise UserError(f"{flag} {path}: not valid JSON ({e})"[:300]) from None
    if not isinstance(cfg, dict):
        raise UserError(f"{flag} {path}: a JSON {type(cfg).__name__}, not an object of config keys")
    if not isinstance(cfg.get("model_type"), str):
        raise UserError(f"{flag} {path}: no 'model_type' string (e.g. \"llama\"); an HF config.json names it")
    for key in SIZE_KEYS:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 < value <= MAX_SIZE):
            raise UserError(f"{flag} {path}: '{key}' is {value!r}; it must be a whole number from 1 to "
                            f"{MAX_SIZE:,}")
    return cfg


def _bad_constant(path: Path, name: str) -> None:
    raise UserError(f"{path}: {name} is not valid JSON")


def check_model_folder(folder: str | os.PathLike, flag: str = "--model") -> dict:
    """Refuse (one line, by name) a folder transformers should not be handed; returns its config."""
    p = Path(folder)
    if not p.is_dir():
        raise UserError(f"{flag} {folder}: no such folder")
    cfg = read_model_config(p, flag)
    check_folder(p)
    check_weight_files(p, flag)
    return cfg


def check_weight_files(folder: Path, flag: str = "--model") -> None:
    """Every ``*.safetensors`` file of the folder has a header whose tensors lie inside the file
    (``SafetensorsFile`` reads the header only): a file cut short is refused naming that file,
    where transformers' own error names neither the file nor the cause."""
    for f in sorted(folder.glob("*.safetensors")):
        try:
            SafetensorsFile(f).close()
        except (ValueError, OSError) as e:
            text = " ".join(str(e).removeprefix(f"{f}: ").split())[:300]
            raise UserError(f"{flag} {f}: damaged or cut short ({text})") from None


@contextlib.contextmanager
def loading(folder: str | os.PathLike, what: str = "model", flag: str = "--model") -> Iterator[None]:
    """Turn what transformers, tokenizers or safetensors raise on the user's folder into a UserError.

    Used only around the calls that read the folder, so a failure there is about its files (an
    unknown ``model_type``, a truncated weight file, a corrupt tokenizer), not a bug of ours.
    """
    try:
        yield
    except UserError:
        raise
    except (MemoryError, NotImplementedError):
        raise
    except Exception as e:  # noqa: BLE001 - whatever the library raises on the folder's files
        text = " ".join(str(e).split())[:300] or type(e).__name__
        raise UserError(f"{flag} {folder}: transformers cannot load the {what} there "
                        f"({type(e).__name__}: {text})") from e


def hf_output_name(name: str) -> bool:
    """The names an HF weights export writes (with --overwrite a command may replace these): stale
    ones left beside new weights would shadow them (an old index, old shards)."""
    return name == "config.json" or (name.startswith("model") and (name.endswith(".safetensors") or
                                                                     name == "model.safetensors.index.json"))


def refuse_missing(info: dict, folder: str | os.PathLike, flag: str = "--model") -> None:
    """Refuse a load whose weights lack parameters the model has (transformers only warns and leaves
    them at random init); ``info`` is ``from_pretrained(..., output_loading_info=True)``'s."""
    missing = sorted(info.get("missing_keys") or [])
    mismatched = [k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys") or []]
    if missing or mismatched:
        names = missing or mismatched
        kind = "has no weight for" if missing else "has weights of the wrong shape for"
        raise UserError(f"{flag} {folder}: the safetensors files {kind} {len(names)} parameter(s) "
                        f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}); refusing to leave "
                        "them at random init")


def read_weight_map(folder: Path, index: Path) -> dict[str, Path]:
    """``model.safetensors.index.json``'s ``weight_map`` with every file confined to ``folder``."""
    data = read_json(confine(folder, index.name, folder, CheckpointError) if index.parent == folder else index)
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(f, str) for f in wm.values()):
        raise CheckpointError(f"{index}: no 'weight_map' object mapping tensor names to file names")
    files = {f: confine(folder, f, index, CheckpointError) for f in set(wm.values())}
    return {name: files[f] for name, f in wm.items()}


def weight_map(folder: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the index or the single file."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return read_weight_map(folder, index)
    single = folder / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json "
                                "(shardwise reads weights from safetensors only)")
    with SafetensorsFile(single) as f:
        return dict.fromkeys(f.tensors, single)
