"""The tokenizer and generation config a run's model goes out with, so ``shardwise generate`` and
plain ``transformers`` can use every export (``RUN/hf/``, ``consolidate``, ``quantize``).

A model trained on raw UTF-8 bytes has no tokenizer files of its own; it is given an HF tokenizer
whose token ids are exactly the bytes (a byte-level BPE vocabulary of the 256 bytes and no merges,
through the ``tokenizers`` library transformers itself uses), so ``AutoTokenizer`` reads it with no
extra package and encodes any text to the ids the model was trained on. A model trained with its
folder's tokenizer goes out with that tokenizer, saved by transformers.

``RUN/tokenizer/`` is written when the run starts (a run stopped before its export still has it:
``consolidate`` of its checkpoints copies it, see ``checkpoint/run_files.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardwise.train.model import ByteTokenizer


def _byte_chars() -> list[str]:
    """One printable character per byte value, the byte-level BPE convention: printable Latin-1
    bytes stand for themselves, the others (controls, space, ...) for the characters from U+0100 on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def byte_hf_tokenizer(max_length: int | None = None) -> Any:
    """A transformers tokenizer whose ids are the UTF-8 bytes of the text (vocabulary 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: b for b, c in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    kwargs = {"model_max_length": max_length} if max_length else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)


def write_side_files(folder: str | Path, tokenizer: Any, model: Any) -> None:
    """Save ``tokenizer`` (HF files; bytes as :func:`byte_hf_tokenizer`) and the model's generation
    config into ``folder`` (rank 0 only): the one the model folder shipped, else one built from the
    model config with the tokenizer's special-token ids."""
    from transformers import GenerationConfig

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    positions = getattr(model.config, "max_position_embeddings", None)
    hf = byte_hf_tokenizer(positions) if isinstance(tokenizer, ByteTokenizer) else tokenizer.tok
    hf.save_pretrained(str(folder))
    gen = getattr(model, "generation_config", None)
    if gen is None or getattr(gen, "_from_model_config", True):  # no generation_config.json came with the model
        gen = GenerationConfig.from_model_config(model.config)
        gen.bos_token_id = hf.bos_token_id  # the ids the data was tokenized with, not the config class's defaults
        gen.eos_token_id = hf.eos_token_id
        gen.pad_token_id = hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id
    gen.save_pretrained(str(folder))
