"""``zero_inference``, a section of ``benchmarks/gpu_check.py``: ZeRO-Inference tokens/s against the copy limit.

A Llama-2-13B-shaped model with random bf16 weights, written once as a safetensors folder
(generated on the GPU, no download) and reused, loaded with ``init_inference(offload="cpu")``
(layers in pinned CPU memory, streamed to the GPU per forward) and timed over greedy tokens at
batch 1. Every token moves every decoder layer host-to-device once, so the fastest it can go is
the pinned host-to-device bandwidth over the layer bytes per token: the section measures that
bandwidth itself (the same copy as ``offload_bandwidth``, right before the tokens) and reports the
tokens/s as a fraction of that limit.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import torch
from gpu.common import MODEL_13B, TINY, copy_gbps, cuda, save_partial, skip
from shared.models import llama


def _sync() -> None:
    if cuda():
        torch.cuda.synchronize()


def pinned_h2d_gbps(mib: int) -> float:
    """Median GB/s of a pinned host-to-device copy of ``mib`` MiB (after one warm-up copy)."""
    dev = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    copy_gbps(dev, host, 1)
    gbps = copy_gbps(dev, host, 5)
    del dev, host
    return gbps


# -- ZeRO-Inference streaming from CPU -----------------------------------------------------------------------
def write_random_model(folder: str, shape: dict, shard_bytes: int = 2 << 30) -> float:
    """A save_pretrained-style folder of random bf16 weights (norms 1); returns seconds (0: reused)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    done = os.path.join(folder, "complete")
    if os.path.exists(done):
        return 0.0
    t0 = time.monotonic()
    os.makedirs(folder, exist_ok=True)
    cfg = LlamaConfig(max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="bfloat16", **shape)
    cfg.save_pretrained(folder)
    meta = llama(shape, "meta")
    _make_room(folder, sum(p.numel() * 2 for p in meta.parameters()))
    gen_device = "cuda" if cuda() else "cpu"
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard.clear()

    for name, p in meta.named_parameters():
        if p.dim() == 1:
            t = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(p.shape, device=gen_device, dtype=torch.bfloat16) * 0.02).cpu()
        shard[name] = t
        if sum(x.numel() * 2 for x in shard.values()) >= shard_bytes:
            flush()
    if shard:
        flush()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    open(done, "w").close()
    return time.monotonic() - t0


def _make_room(folder: str, nbytes: int) -> None:
    """Drop the shards of an earlier, unfinished write and refuse to start one the disk cannot hold:
    26 GB at 13B, on a 64 GiB disk; better a one-line error now than ENOSPC minutes into the section."""
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(folder, name))
    free, spare = shutil.disk_usage(folder).free, min(nbytes, 2 << 30)
    if free < nbytes + spare:
        raise OSError(f"{folder}: {free / 1e9:.1f} GB free, the random model needs {nbytes / 1e9:.1f} GB "
                      f"(+{spare / 1e9:.1f} GB spare); pass --workdir on a larger disk")


def zero_inference(smoke: bool, workdir: str, limit_s: float) -> dict:  # noqa: ARG001
    if not cuda() and not smoke:
        return skip("no CUDA device")
    from shardwise.inference import init_inference, stream_state_of

    shape, tokens = (TINY, 4) if smoke else (MODEL_13B, 8)
    folder = os.path.join(workdir, "random_llama_tiny" if smoke else "random_llama_13b")
    row: dict = {"model": "llama-13b-random" if not smoke else "llama-tiny-random", "offload": "cpu", "batch": 1}
    row["write_s"] = write_random_model(folder, shape)
    save_partial([row])  # a section killed at its limit still says how far it got
    t0 = time.monotonic()
    model = init_inference(folder, offload="cpu", dtype=torch.bfloat16)
    row["load_s"] = time.monotonic() - t0
    # the embedding stays resident where the layers are streamed to: the device the tokens are computed on
    device = model.get_input_embeddings().weight.device
    row.update(device=str(device), streamed=stream_state_of(model) is not None,
               params_B=sum(p.numel() for p in model.parameters()) / 1e9)  # the placeholders keep full shapes
    save_partial([row])
    ids = torch.randint(0, shape["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(1)).to(device)
    kw = {"do_sample": False, "pad_token_id": 0}
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)  # warm up (allocator, kernels)
    _sync()
    t0 = time.monotonic()
    out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
    _sync()
    gen_s = time.monotonic() - t0
    new = out.shape[1] - ids.shape[1]
    layer_bytes = sum(p.numel() * 2 for n, p in model.named_parameters() if ".layers." in n)
    row.update(new_tokens=new, tokens_per_s=new / gen_s, layer_GB_per_token=layer_bytes / 1e9)
    if device.type == "cuda":  # the copy limit, measured now on this machine (1 GiB, as offload_bandwidth)
        gbps = pinned_h2d_gbps(64 if smoke else 1024)
        limit = gbps * 1e9 / layer_bytes
        row.update(pinned_h2d_GBps=gbps, copy_limit_tokens_per_s=limit, fraction_of_copy_limit=new / gen_s / limit)
    ok = row["streamed"] and (device.type == "cuda" or smoke)  # never CPU numbers under a GPU check's name
    return {"status": "ok" if ok else "partial", "rows": [row],
            "notes": ["tokens/s over greedy tokens after a 1-token warm-up, prompt of 16 (prefill included); "
                      "every token streams the decoder layers from pinned CPU memory, so copy_limit_tokens_per_s "
                      "= pinned_h2d_GBps / layer_GB_per_token is the most it can do (CUDA only)"]}
