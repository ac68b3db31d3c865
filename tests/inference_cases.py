"""ZeRO-Inference checks run on ranks or in fresh processes (used by test_inference.py).

``python tests/inference_cases.py measure DIR MODE NEW_TOKENS [PREFETCH]`` prints one JSON line:
the peak RSS growth of generating with MODE (``plain`` transformers, ``resident``, ``cpu``,
``disk``) over the process's baseline after imports, and tokens/s. A fresh process per number,
because peak RSS only ever grows.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

GEN = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)


def prompt(vocab: int = 509, batch: int = 2, seq: int = 5) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(7))


def save_tiny(kind: str, folder: str) -> None:
    """A tiny model (tests/tiny_models.py) saved as safetensors, with a word-level tokenizer."""
    from tiny_models import VOCAB, build

    build(kind).eval().save_pretrained(folder)
    save_tokenizer(folder, VOCAB)


def save_tokenizer(folder: str, vocab: int) -> None:
    """A word-level tokenizer whose ids are the words ``w0 .. w{vocab-1}`` (built in code, no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0").save_pretrained(folder)


def reference(folder: str, gen: dict | None = None) -> list:
    """Greedy tokens of plain transformers, weights resident."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model.generate(prompt(), **(gen or GEN)).tolist()


def stream(folder: str, offload: str | None, prefetch: int = 1) -> dict:
    """On every rank: greedy tokens through init_inference, and what the fetcher saw."""
    from shardwise.inference import init_inference

    model = init_inference(folder, offload=offload, prefetch=prefetch)
    out = model.generate(prompt(), **GEN)
    fetcher, files = model.shardwise_fetcher, getattr(model, "shardwise_files", None)
    layer = sum(g.padded_numel * g.flat_param.element_size() for g in model.shardwise_groups[0])
    return {"tokens": out.tolist(), "peak_gathered": fetcher.peak_gathered_bytes if fetcher else None,
            "layer_bytes": layer, "bytes_read": files.bytes_read if files else None,
            "file_bytes": sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                              if f.endswith(".safetensors"))}


def tensor_parallel(folder: str) -> list:
    """On every rank: greedy tokens of init_inference with tensor_parallel_size = world."""
    import torch.distributed as dist

    from shardwise.inference import init_inference

    model = init_inference(folder, tensor_parallel_size=dist.get_world_size())
    return model.generate(prompt(), **GEN).tolist()


def save_large(folder: str, layers: int, hidden: int, inter: int, vocab: int = 512) -> dict:
    """A Llama of ``layers`` decoder layers saved to ``folder`` (fp32); returns its sizes in bytes."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                      max_position_embeddings=256, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(folder)
    save_tokenizer(folder, vocab)
    layer = sum(p.numel() for p in model.model.layers[0].parameters()) * 4
    return {"model_bytes": sum(p.numel() for p in model.parameters()) * 4, "layer_bytes": layer}


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure(folder: str, mode: str, new_tokens: int, prefetch: int = 1, batch: int = 1) -> dict:
    """Peak RSS growth over the post-import baseline, and tokens/s, of one generation."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama  # noqa: F401 (imported before the baseline)

    from shardwise.inference import init_inference

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    ids = prompt(vocab=512, batch=batch, seq=8)
    baseline = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    t0 = time.perf_counter()
    if mode == "plain":
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
    else:
        model = init_inference(folder, offload=None if mode == "resident" else mode, prefetch=prefetch)
    t1 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    t2 = time.perf_counter()
    fetcher = getattr(model, "shardwise_fetcher", None)
    return {"mode": mode, "prefetch": prefetch, "baseline": baseline, "peak_growth": _rss("VmHWM") - baseline,
            "load_s": t1 - t0, "tokens_per_s": batch * new_tokens / (t2 - t1),
            "peak_gathered": fetcher.peak_gathered_bytes if fetcher else None, "tokens": out[0].tolist()}


if __name__ == "__main__":
    if sys.argv[1] == "measure":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        print(json.dumps(measure(sys.argv[2], sys.argv[3], int(sys.argv[4]),
                                 int(sys.argv[5]) if len(sys.argv) > 5 else 1,
                                 int(sys.argv[6]) if len(sys.argv) > 6 else 1)))
