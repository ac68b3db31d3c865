"""Tokenize a document of any length in bounded memory, to exactly the tokens of one whole call.

Encoding a 50 MB document in one call held it as a Python list of ints (16x the file). Here the
text arrives in pieces and is encoded a chunk (about ``CHUNK_CHARS``) at a time, each chunk's ids
going straight to a numpy array. A chunk may only end where encoding the two sides separately
gives the tokens of the whole:

- a byte tokenizer (``splits_anywhere``) may be cut anywhere;
- any other tokenizer is cut only just before a space that starts a word after a word
  (``"...x| y..."``): a pre-token boundary of byte-level BPE (GPT-2, Llama 3 and similar regex
  pre-tokenizers attach the space to the next word and never join across it). Each cut is also
  checked on its neighbourhood: ``CHECK_CHARS`` either side encoded whole must equal the two
  sides encoded apart. A tokenizer for which no cut passes (one that adds a prefix space to
  every call, like SentencePiece's legacy normalizer) is not cut: that document is then encoded
  whole, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

READ_BYTES = 1 << 20  # bytes read from a text file at a time
CHUNK_CHARS = 1 << 20  # characters encoded per call (the memory bound, with its ids)
CHECK_CHARS = 256  # characters either side of a cut that must encode the same apart and whole
MAX_TRIES = 8  # cut candidates checked per chunk before the chunk is allowed to grow


def _word_starts(text: str, lo: int, hi: int) -> Iterator[int]:
    """Positions ``i`` in ``[lo, hi)``, last first, where ``text[i]`` is a space between two words."""
    i = text.rfind(" ", lo, hi)
    while i > lo:
        if not text[i - 1].isspace() and i + 1 < len(text) and not text[i + 1].isspace():
            yield i
        i = text.rfind(" ", lo, i)


def find_cut(tokenizer, text: str) -> int | None:
    """Where ``text`` may be cut (encoding both sides apart equals encoding it whole), or None."""
    hi = len(text) - CHECK_CHARS
    if hi <= CHECK_CHARS:
        return None
    if getattr(tokenizer, "splits_anywhere", False):
        return hi
    for tries, i in enumerate(_word_starts(text, max(CHECK_CHARS, hi - CHUNK_CHARS), hi)):
        if tries == MAX_TRIES:
            return None
        window = text[i - CHECK_CHARS:i + CHECK_CHARS]
        if list(tokenizer.encode(window)) == list(tokenizer.encode(window[:CHECK_CHARS])) + \
                list(tokenizer.encode(window[CHECK_CHARS:])):
            return i
    return None


def encode_stream(tokenizer, pieces: Iterable[str], dtype: np.dtype) -> Iterator[tuple[np.ndarray, str]]:
    """``(ids, last character so far)`` for consecutive chunks of the text made of ``pieces``; the
    ids, concatenated, are ``tokenizer.encode("".join(pieces))``."""
    buf, last = "", ""
    for piece in pieces:
        if not piece:
            continue
        buf += piece
        last = piece[-1]
        while len(buf) >= CHUNK_CHARS + CHECK_CHARS:
            cut = find_cut(tokenizer, buf)
            if cut is None:
                break  # no safe cut in the last chunk: let it grow (checked again after the next piece)
            yield np.asarray(tokenizer.encode(buf[:cut]), dtype=dtype), last
            buf = buf[cut:]
    if buf:
        yield np.asarray(tokenizer.encode(buf), dtype=dtype), last
