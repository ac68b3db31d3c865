"""The streamed generation's memory bound, term by term: what ``generate --verbose`` prints.

A streamed model holds, above the process's baseline (anonymous memory; library code paged in is
file-backed and counted apart):

    root + pool + buffers + kv_cache + activations + allocator_slack

* ``root``: what stays resident: embeddings, final norm, head (and, for ``offload="cpu"`` or a
  quantized store in memory, every layer's shard): ``memory_report()["params"]``.
* ``pool``: the fixed gather pool, ``k = prefetch + 1`` layers, made once (``zero/gather_pool.py``);
  nothing else holds a whole layer, whatever the threads' timing.
* ``staging``: reused read buffers: a dtype-converting read's staging buffer per thread
  (``SafetensorsFile.STAGE_BYTES``) and a quantized store's dequantization buffers.
* ``kv_cache``: ``2 x layers x batch x kv_heads x head_dim x length`` elements of the compute dtype,
  plus one layer's share while its cache grows by a concatenation (old and new alive at once).
* ``activations``: the largest step's transient tensors: a prefill of ``batch x prompt`` tokens through
  one layer (hidden states, q/k/v, the MLP's three ``intermediate`` wide tensors, attention scores),
  and the last position's logits in fp32, twice (logits and their processed copy).
* ``runtime``: a measured constant for what a first load and generation add whatever the model
  (the module tree's objects, libtorch's and transformers' first-call state): ``RUNTIME_BYTES``.
* ``allocator_slack``: the free heap glibc may keep per arena once its thresholds are pinned
  (``inference.allocator``); without the pin (not glibc) there is no such constant and the bound is
  reported as not holding by construction.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.files.safetensors_io import SafetensorsFile
from shardwise.inference.allocator import ARENAS, allocator_slack, is_pinned
from shardwise.inference.stream import stream_state_of

# Not by construction but measured: what the first load and generation add whatever the model's
# size (the module tree's Python objects, libtorch's and transformers' first-call state). 18-26 MiB
# on a 3-layer model and on a 24-layer one alike (stop 31, docs/inference.md).
RUNTIME_BYTES = 32 << 20


def _config_value(config: Any, *names: str, default: int = 0) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


def memory_bound(model: nn.Module, batch: int, prompt: int, new_tokens: int) -> dict[str, int | bool]:
    """The bound's terms in bytes for generating ``new_tokens`` after a ``prompt``-token prompt,
    ``batch`` sequences at once, and their ``total``; ``by_construction`` says whether the
    allocator term is a pinned constant."""
    report = model.memory_report()
    cfg = model.config
    layers = _config_value(cfg, "num_hidden_layers", "n_layer")
    hidden = _config_value(cfg, "hidden_size", "n_embd")
    heads = _config_value(cfg, "num_attention_heads", "n_head", default=1)
    kv_heads = _config_value(cfg, "num_key_value_heads", default=heads)
    head_dim = _config_value(cfg, "head_dim", default=hidden // heads)
    inter = _config_value(cfg, "intermediate_size", "n_inner", default=4 * hidden)
    vocab = _config_value(cfg, "vocab_size")
    size = next((p.element_size() for p in model.parameters() if p.is_floating_point()),
                torch.empty((), dtype=torch.float32).element_size())
    length = prompt + new_tokens
    per_layer_kv = 2 * batch * kv_heads * head_dim * length * size
    tokens = batch * prompt
    scores = batch * heads * prompt * prompt * size
    prefill = tokens * (4 * hidden + 2 * kv_heads * head_dim + 3 * inter) * size + scores
    files = getattr(stream_state_of(model), "files", None)
    terms: dict[str, int | bool] = {
        "root": report["params"], "pool": report["gather_pool"], "buffers": report["buffers"],
        "staging": getattr(files, "staging_bytes", 0) + SafetensorsFile.STAGE_BYTES * ARENAS,
        "kv_cache": (layers + 1) * per_layer_kv, "activations": prefill + 2 * batch * vocab * 4,
        "allocator_slack": allocator_slack(), "runtime": RUNTIME_BYTES}
    terms["total"] = sum(v for v in terms.values())
    terms["by_construction"] = is_pinned()
    return terms


def human(n: int | float) -> str:
    """Bytes in binary units, three significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"  # unreachable: GiB is the last unit


def format_bound(terms: dict[str, int | bool], peak: int | None) -> str:
    """One line: each term, the total, and the measured peak (anonymous growth) against it."""
    parts = ", ".join(f"{k} {human(v)}" for k, v in terms.items() if k not in ("total", "by_construction"))
    line = f"memory bound {human(terms['total'])} ({parts})"
    if not terms["by_construction"]:
        line += " [allocator not pinned: the bound is not guaranteed here]"
    if peak is not None:
        line += f"; measured peak {human(peak)} ({peak / max(int(terms['total']), 1):.0%} of the bound)"
    return line
