"""ZeRO-Inference checks run on ranks or in fresh processes (used by test_inference.py).

``python tests/inference_cases.py measure DIR MODE NEW_TOKENS [PREFETCH [BATCH [WARMUP]]]`` prints one JSON line:
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
    from shardwise.inference.load import init_inference
    from shardwise.inference.stream import stream_state_of

    model = init_inference(folder, offload=offload, prefetch=prefetch)
    out = model.generate(prompt(), **GEN)
    state = stream_state_of(model)
    fetcher, files = state.fetcher, state.files
    layer = sum(g.padded_numel * g.flat_param.element_size() for g in state.groups[0])
    return {"tokens": out.tolist(), "peak_gathered": fetcher.peak_gathered_bytes if fetcher else None,
            "layer_bytes": layer, "bytes_read": files.bytes_read if files else None,
            "root_bytes": sum(g.memory()["params"] for g in state.groups[-1]),
            "file_bytes": sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                              if f.endswith(".safetensors"))}


def tensor_parallel(folder: str, offload: str | None = None, quantize: str | None = None) -> list:
    """On every rank: greedy tokens of init_inference with tensor_parallel_size = world."""
    import torch.distributed as dist

    from shardwise.inference.load import init_inference

    model = init_inference(folder, tensor_parallel_size=dist.get_world_size(), offload=offload, quantize=quantize)
    return model.generate(prompt(), **GEN).tolist()


def save_large(folder: str, layers: int, hidden: int, inter: int, vocab: int = 512,
               dtype: torch.dtype = torch.float32) -> dict:
    """A Llama of ``layers`` decoder layers saved to ``folder`` in ``dtype``; returns its sizes in bytes."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                      max_position_embeddings=256, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.save_pretrained(folder)
    save_tokenizer(folder, vocab)
    size = torch.empty((), dtype=dtype).element_size()
    layer = sum(p.numel() for p in model.model.layers[0].parameters()) * size
    return {"model_bytes": sum(p.numel() for p in model.parameters()) * size, "layer_bytes": layer}


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure(folder: str, mode: str, new_tokens: int, prefetch: int = 1, batch: int = 1, warmup: int = 0) -> dict:
    """Peak RSS growth over the post-import baseline, and tokens/s, of one generation.

    ``warmup``: first a generation of that many tokens, untimed, so tokens/s is the steady decode
    rate (not the first call's one-off costs, a large share of 8 fast int4 tokens)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama  # noqa: F401 (imported before the baseline)

    from shardwise.inference.load import init_inference
    from shardwise.inference.stream import stream_state_of

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    ids = prompt(vocab=512, batch=batch, seq=8)
    baseline, file_baseline = _rss("VmRSS"), _rss("RssFile")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    t0 = time.perf_counter()
    split = _time_split() if os.environ.get("SHARDWISE_BENCH_SPLIT") == "1" else None
    if mode == "plain":
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
    elif mode == "accelerate":  # Accelerate's disk offload: a CPU budget of a fifth of the weights
        budget = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
        model = AutoModelForCausalLM.from_pretrained(folder, device_map="auto", max_memory={"cpu": budget // 5},
                                                     offload_folder=os.path.join(folder, "accelerate_offload")).eval()
    else:
        model = init_inference(folder, offload=None if mode == "resident" else mode, prefetch=prefetch)
    t1 = time.perf_counter()
    if warmup:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=warmup, min_new_tokens=warmup, do_sample=False, pad_token_id=0)
    state = stream_state_of(model)
    files = state.files if state is not None else None
    read0 = files.bytes_read if files is not None else 0
    t_gen = time.perf_counter()
    if split is not None:  # the generation's time only, not the load's (nor the warm-up's)
        split.update(dict.fromkeys(split, 0.0))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    t2 = time.perf_counter()
    read = (files.bytes_read - read0) / new_tokens if files is not None else 0
    fetcher = state.fetcher if state is not None else None
    report = model.memory_report() if fetcher else {}
    return {"mode": mode, "prefetch": prefetch, "baseline": baseline, "peak_growth": _rss("VmHWM") - baseline,
            "file_growth": _rss("RssFile") - file_baseline,
            "load_s": t1 - t0, "tokens_per_s": batch * new_tokens / (t2 - t_gen),
            "peak_gathered": fetcher.peak_gathered_bytes if fetcher else None, "tokens": out[0].tolist(),
            "resident": report.get("params", 0), "gather_pool": report.get("gather_pool", 0),
            "deferred": report.get("gather_pool_deferred", 0), "read_per_token": read,
            "split_s_per_token": {k: v / new_tokens for k, v in split.items()} if split else None,
            "placement": sorted(set(getattr(model, "hf_device_map", {}).values()))}


def forked_runs(jobs: list[tuple[str, str]], runs: int, new_tokens: int = 2) -> dict[tuple[str, str], list[dict]]:
    """``measure`` for each (folder, mode) in ``runs`` fresh processes, two at a time (2 cores).

    ``new_tokens=2``: the prompt's forward, then one decode step with the KV cache. A third or fourth
    token repeats that step (the same layers gathered into the same pool) and costs CPU, not memory:
    the fp32 64-layer streamed run took 1.81 CPU s with 4 tokens and 0.87 with 2 (AMD EPYC).

    Each process is forked from the suite's server that has imported torch, transformers' Llama and
    shardwise (multiprocessing's forkserver, ``fresh_ranks.PRELOAD``, one task per process): it starts where a fresh
    interpreter stands after those imports, takes its own baseline and peak (``measure`` resets the
    peak to the current RSS first) and exits. The imports, about 7 s a process on 2 cores, are paid
    once instead of once per run. Such a child starts with fewer library pages mapped than a fresh
    interpreter has after the same imports (fork shares file pages lazily), so what it touches
    again counts as growth: 7-10 MB more excess per run than fresh processes on the AMD machine
    (``benchmarks/inference/bench_inference.py --memory-runs 3``), a stricter figure for the same bound."""
    import fresh_ranks

    ctx = fresh_ranks.context()  # the suite's forkserver (its preload includes the imports above)
    todo = [job for job in jobs for _ in range(runs)]
    with ctx.Pool(2, maxtasksperchild=1) as pool:
        results = pool.starmap(measure, [(folder, mode, new_tokens) for folder, mode in todo], chunksize=1)
    out: dict[tuple[str, str], list[dict]] = {job: [] for job in jobs}
    for job, r in zip(todo, results, strict=True):
        out[job].append(r)
    return out


def _time_split() -> dict:
    """Seconds spent reading (reader thread: overlaps compute), dequantizing and in the int4
    kernel, accumulated by wrapping those functions (for the benchmark's time split only)."""
    from shardwise.files.safetensors_io import SafetensorsFile
    from shardwise.inference.quantized_linear import Int4Linear
    from shardwise.inference.quantized_store import QuantizedStore

    acc = {"read": 0.0, "dequantize": 0.0, "int4_kernel": 0.0}

    def timed(cls, name, key):
        fn = getattr(cls, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[key] += time.perf_counter() - t
        setattr(cls, name, wrapper)

    timed(SafetensorsFile, "read_raw", "read")
    timed(QuantizedStore, "_dequantize", "dequantize")
    timed(Int4Linear, "forward", "int4_kernel")
    return acc


def train_sonnets(folder: str, steps: int = 300, seed: int = 0) -> torch.Tensor:
    """A tiny character-level Llama trained briefly on data/sonnets.txt (plain torch AdamW, one
    process), saved to ``folder``; returns the text as token ids (a quantized model is judged on
    a model that has learned something: a random one says nothing about quality)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "data", "sonnets.txt")) as f:
        text = f.read()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text])
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(chars), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                      tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 65, (16,), generator=g)
        batch = torch.stack([ids[s:s + 65] for s in starts.tolist()])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().save_pretrained(folder)
    return ids


def perplexity(model: torch.nn.Module, ids: torch.Tensor, seq: int = 128) -> float:
    """exp(mean next-token loss) over the text cut into windows of ``seq`` tokens."""
    n = (len(ids) // seq) * seq
    windows = ids[:n].view(-1, seq)
    with torch.no_grad():
        loss = model(input_ids=windows, labels=windows).loss
    return float(torch.exp(loss))


if __name__ == "__main__":
    if sys.argv[1] == "measure":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        print(json.dumps(measure(sys.argv[2], sys.argv[3], int(sys.argv[4]),
                                 int(sys.argv[5]) if len(sys.argv) > 5 else 1,
                                 int(sys.argv[6]) if len(sys.argv) > 6 else 1,
                                 int(sys.argv[7]) if len(sys.argv) > 7 else 0)))
