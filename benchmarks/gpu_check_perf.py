"""The timed sections of ``benchmarks/gpu_check.py``: bf16 training against FSDP2, ZeRO-Inference tokens/s.

``step_vs_fsdp2``: shardwise ZeRO-3 (bf16 compute, fp32 master) and FSDP2 (``fully_shard`` per
decoder layer and the root, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), both
with torch's AdamW, on the same ~1B Llama and batches; each run is a fresh process (its own peak
memory), the two alternate in rounds, and the table gives each round and the medians.

``zero_inference``: a Llama-2-13B-shaped model with random bf16 weights, written once as a
safetensors folder (generated on the GPU, no download) and reused, loaded with
``init_inference(offload="cpu")`` (layers in pinned CPU memory, streamed to the GPU per forward)
and timed over greedy tokens at batch 1.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time

import torch
from gpu_check_common import (
    MODEL_1B,
    MODEL_13B,
    TINY,
    cuda,
    engine_config,
    join_world_of_one,
    llama,
    run_child,
    save_partial,
    skip,
)


# -- bf16 step against FSDP2 -------------------------------------------------------------------------------
def _sync() -> None:
    if cuda():
        torch.cuda.synchronize()


def _fsdp2(model: torch.nn.Module):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, **({"fused": True} if cuda() else {}))

    def step(ids: torch.Tensor) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)

    return step


def _shardwise(model: torch.nn.Module, micro: int):
    import shardwise

    cfg = engine_config(3, "bf16", micro=micro)
    cfg["optimizer"]["params"].update(lr=1e-4)
    engine, _, _, _ = shardwise.initialize(model=model, config=cfg)

    def step(ids: torch.Tensor) -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return float(loss)

    return step


def step_worker(impl: str, smoke: bool) -> dict:
    """One run (one process): seconds per step (median of the measured steps) and peak memory."""
    join_world_of_one()
    from shardwise.comm import compute_device

    device = compute_device()
    shape, micro, seq, warmup, steps = (TINY, 2, 32, 1, 2) if smoke else (MODEL_1B, 4, 1024, 3, 8)
    model = llama(shape, device)
    numel = sum(p.numel() for p in model.parameters())
    step = _shardwise(model, micro) if impl == "shardwise" else _fsdp2(model)
    ids = torch.randint(0, shape["vocab_size"], (warmup + steps, micro, seq),
                        generator=torch.Generator().manual_seed(1)).to(device)
    if device.type == "cuda":  # the peak of the steps (resident state included), on the device they ran on
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], 0.0
    for i in range(warmup + steps):
        _sync()
        t0 = time.perf_counter()
        loss = step(ids[i])
        _sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"impl": impl, "device": str(device), "params_B": numel / 1e9,
            "s_per_step": statistics.median(times[warmup:]), "peak_GiB": peak, "last_loss": loss,
            "tokens_per_step": micro * seq}


def step_vs_fsdp2(smoke: bool, workdir: str, limit_s: float) -> dict:
    if not cuda() and not smoke:
        return skip("no CUDA device")
    rounds = 1 if smoke else 2
    deadline, rows = time.monotonic() + limit_s - 5, []
    for r in range(rounds):
        order = ("shardwise", "fsdp2") if r % 2 == 0 else ("fsdp2", "shardwise")
        for impl in order:
            left = deadline - time.monotonic()
            if smoke:  # in this process: the smoke run checks the code paths, not the peaks
                res = step_worker(impl, smoke)
            else:
                res = run_child(["step_worker", "--impl", impl], os.path.join(workdir, f"step_{impl}_{r}.json"), left)
            rows.append({"round": r + 1, "impl": impl, **res})
            save_partial(rows)
    notes = []
    med = {impl: [x["s_per_step"] for x in rows if x["impl"] == impl and "s_per_step" in x]
           for impl in ("shardwise", "fsdp2")}
    if med["shardwise"] and med["fsdp2"]:
        sw, fs = statistics.median(med["shardwise"]), statistics.median(med["fsdp2"])
        notes.append(f"median s/step: shardwise ZeRO-3 {sw:.4f}, FSDP2 {fs:.4f}: shardwise at {fs / sw:.2f}x "
                     "FSDP2's speed (above 1: faster)")
    ok = all("error" not in x for x in rows)
    return {"status": "ok" if ok else "partial", "rows": rows, "notes": notes}


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
    ok = row["streamed"] and (device.type == "cuda" or smoke)  # never CPU numbers under a GPU check's name
    return {"status": "ok" if ok else "partial", "rows": [row],
            "notes": ["tokens/s over greedy tokens after a 1-token warm-up, prompt of 16 (prefill included); "
                      "every token streams the decoder layers from pinned CPU memory"]}
