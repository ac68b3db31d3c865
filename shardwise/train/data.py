"""Local text data: read, tokenize once into a memory-mapped token file, pack, split, order by step.

Sources: a UTF-8 text file, a folder of them (recursively, sorted, hidden files skipped), or JSONL
with a ``text`` field (``.jsonl`` files, also inside folders). Documents are tokenized once, by
global rank 0, into ``RUN_DIR/data/tokens-<key>.bin`` (numpy memmap; the key hashes the sources'
names, sizes and mtimes and the tokenizer), so a resumed or repeated run reads it back at no cost.

The token stream is cut into non-overlapping sequences of ``seq`` tokens; the last
``eval_fraction`` of them are held out. The order of training sequences is a function of
``(seed, step)`` only: epoch ``e`` is ``default_rng([seed, e]).permutation(n_train)``, and step
``s`` takes global positions ``[s*B, (s+1)*B)`` of the concatenated epochs, so a run resumed at step
``s`` (at any world size with the same global batch ``B``) reads exactly the batches an
uninterrupted run would have read.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardwise.files.safe import commit_temp, confine, hub_roots, open_regular, open_temp, write_atomic
from shardwise.train.jsonl_stream import jsonl_texts
from shardwise.train.tokenize_stream import READ_BYTES, encode_stream


class DataError(ValueError):
    """Unusable data; the message names the file (and line) and the fix."""


def list_sources(data: str | Path) -> list[Path]:
    """The files --data names, in a fixed order; every one a regular file inside the folder.

    Symlinks are not followed out of the folder and special files (FIFOs, devices) are refused by
    name (``files.safe``); symlinked sub-folders are not walked.
    """
    p = Path(data)
    if p.is_file():
        os.close(open_regular(p, DataError))
        return [p]
    if p.is_dir():
        files = []
        for top, dirs, names in os.walk(p, followlinks=False):
            rel_top = Path(top).relative_to(p)
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not (Path(top) / d).is_symlink())
            for name in sorted(names):
                if name.startswith(".") or any(part.startswith(".") for part in rel_top.parts):
                    continue
                full = confine(p, str(rel_top / name), f"--data {p}", DataError, hub_roots(p))
                os.close(open_regular(full, DataError, nofollow=True))
                files.append(Path(top) / name)
        if not files:
            raise DataError(f"--data {p}: the folder holds no files")
        return sorted(files)
    raise DataError(f"--data {p}: no such file or folder")


def read_documents(path: Path, text_key: str = "text") -> Iterator[str]:
    """The documents of one file, each whole: the text file, or each JSONL line's ``text_key`` string."""
    for pieces in document_pieces(path, text_key):
        yield "".join(pieces)


def document_pieces(path: Path, text_key: str = "text") -> Iterator[Iterator[str]]:
    """The documents of one file, each as an iterator of text pieces of at most ``READ_BYTES``
    (a JSONL record's text too, ``jsonl_stream``): memory is bounded by a piece, not by the
    largest document or record."""
    if path.suffix == ".jsonl":
        yield from _jsonl_texts(path, text_key)
    else:
        yield _text_pieces(path)


def _text_pieces(path: Path) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder("utf-8")()
    done = 0
    with os.fdopen(open_regular(path, DataError), "rb") as f:
        while True:
            raw = f.read(READ_BYTES)
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not UTF-8 text (byte {done + e.start}); remove the file from --data "
                                "or convert it") from None
            done += len(raw)
            if text:
                yield text
            if not raw:
                return


def _jsonl_texts(path: Path, text_key: str) -> Iterator[Iterator[str]]:
    with os.fdopen(open_regular(path, DataError), "rb") as f:
        yield from jsonl_texts(f, text_key, lambda line, msg: _jsonl_error(path, line, msg, text_key))


def _jsonl_error(path: Path, line: int, msg: str, text_key: str) -> DataError:
    if msg.startswith("not a JSON object") or msg == "not UTF-8 text":
        msg += f"; each line of a .jsonl file must be {{\"{text_key}\": \"...\"}}"
    return DataError(f"{path}:{line}: {msg}")


def _cache_key(sources: list[Path], tokenizer_name: str, text_key: str) -> str:
    h = hashlib.sha256(f"{tokenizer_name}\0{text_key}".encode())
    for f in sources:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:16]


def tokenize_to_cache(sources: list[Path], tokenizer, cache_dir: Path, text_key: str = "text") -> Path:
    """Write (or reuse) the token file for ``sources``; returns the path of its ``.json`` description.

    Documents are separated by the tokenizer's EOS token, or a newline when it has none (bytes).
    Written to a temporary name and renamed, so a crash never leaves a half file that looks done.
    """
    key = _cache_key(sources, tokenizer.name, text_key)
    meta_path = cache_dir / f"tokens-{key}.json"
    if meta_path.is_file():
        return meta_path
    cache_dir.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    bin_path = cache_dir / f"tokens-{key}.bin"
    n, docs = 0, 0
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else tokenizer.encode("\n")
    sep_ids = np.asarray(sep, dtype=dtype)
    from tqdm.auto import tqdm  # a large corpus takes minutes: a bar on a terminal (none in logs, disable=None)

    bar = tqdm(desc="tokenizing --data", unit="tok", unit_scale=True, file=sys.stderr, disable=None, leave=False)
    with open_temp(bin_path) as out:
        for f in sources:
            for pieces in document_pieces(f, text_key):
                last = ""
                for ids, tail in encode_stream(tokenizer, pieces, dtype):
                    ids.tofile(out)
                    n, last = n + len(ids), tail
                    bar.update(len(ids))
                if not last.endswith("\n") or tokenizer.eos_token_id is not None:
                    sep_ids.tofile(out)
                    n += len(sep_ids)
                docs += 1
        bar.close()
        out.flush()
        os.fsync(out.fileno())
    commit_temp(bin_path)
    meta = {"file": bin_path.name, "dtype": np.dtype(dtype).name, "tokens": n, "documents": docs,
            "tokenizer": tokenizer.name, "sources": [str(f) for f in sources]}
    write_atomic(meta_path, json.dumps(meta, indent=1).encode())
    return meta_path


@dataclass
class TokenData:
    """Packed sequences over a memmapped token file, split into train and held-out eval."""

    tokens: np.ndarray
    seq: int
    n_train: int
    n_eval: int
    seed: int

    @classmethod
    def open(cls, meta_path: Path, seq: int, eval_fraction: float, seed: int) -> TokenData:
        meta = json.loads(meta_path.read_text())
        tokens = np.memmap(meta_path.parent / meta["file"], dtype=meta["dtype"], mode="r")
        n_seq = len(tokens) // seq
        n_eval = int(round(n_seq * eval_fraction)) if eval_fraction > 0 else 0
        if eval_fraction > 0:
            n_eval = max(1, n_eval)
        n_train = n_seq - n_eval
        if n_train < 1:
            raise DataError(f"the data has {len(tokens)} tokens: {n_seq} sequence(s) of --seq {seq}, "
                            f"{n_eval} held out by --eval-fraction {eval_fraction}, none left to train on; "
                            "give more data, a shorter --seq or a smaller --eval-fraction")
        return cls(tokens, seq, n_train, n_eval, seed)

    def sequence(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[i * self.seq:(i + 1) * self.seq], dtype=np.int64)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        cached = getattr(self, "_order", None)
        if cached is None or cached[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_train))
        return self._order[1]

    def train_ids(self, step: int, global_batch: int) -> list[int]:
        """The training sequence indices of global batch ``step`` (independent of the world layout)."""
        out = []
        for pos in range(step * global_batch, (step + 1) * global_batch):
            epoch, i = divmod(pos, self.n_train)
            out.append(int(self._epoch_order(epoch)[i]))
        return out

    def micro_batches(self, step: int, micro: int, gas: int, dp_rank: int, dp_world: int) -> list[torch.Tensor]:
        """This data-parallel rank's ``gas`` micro-batches of step ``step``, each ``[micro, seq]``.

        Micro-batch ``m`` of rank ``r`` holds global positions ``(m*dp_world + r)*micro ...``, so at
        every layout the accumulated step averages the same ``micro*gas*dp_world`` sequences.
        """
        ids = self.train_ids(step, micro * gas * dp_world)
        out = []
        for m in range(gas):
            start = (m * dp_world + dp_rank) * micro
            rows = [self.sequence(i) for i in ids[start:start + micro]]
            out.append(torch.from_numpy(np.stack(rows)))
        return out

    def eval_batches(self, micro: int) -> list[torch.Tensor]:
        """The held-out sequences in order, in batches of up to ``micro``."""
        ids = list(range(self.n_train, self.n_train + self.n_eval))
        return [torch.from_numpy(np.stack([self.sequence(i) for i in ids[s:s + micro]]))
                for s in range(0, len(ids), micro)]
