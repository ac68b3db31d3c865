"""``step_vs_fsdp2``, a timed section of ``benchmarks/gpu_check.py``: bf16 training against FSDP2 and torch.

shardwise ZeRO-3 (bf16 compute, fp32 master), FSDP2 (``fully_shard`` per decoder layer and the root,
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``) and torch's own single-GPU baseline
(fp32 weights, ``autocast`` to bf16, fused AdamW: what a user without any sharding library runs), all
with torch's AdamW, on the same ~1B Llama and batches; each run is a fresh process (its own peak
memory), the three alternate in rounds, and the table gives each round, the medians and the MFU.

MFU: model FLOPs per step over seconds per step over the GPU's dense bf16 peak (a table by device
name; None for a device not in it and on CPU). Model FLOPs per step = (6 N + 12 L h s) T, PaLM's
count: N the parameters doing matmuls (all but the input embedding), L layers, h hidden size, s the
sequence length, T tokens per step (the attention term, causal masking not subtracted).
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from gpu.common import (
    MODEL_1B,
    TINY,
    cuda,
    engine_step,
    in_own_process,
    join_world_of_one,
    optimizer_step,
    run_child,
    save_partial,
    skip,
)
from shared.models import engine_config, llama

# dense bf16 tensor-core peak FLOP/s by device name (the vendors' data sheets, without sparsity)
# (the longest name found in the device's name wins: "H100 PCIe" before "H100")
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "H100 PCIe": 756e12, "A100": 312e12}
IMPLS = ("shardwise", "fsdp2", "torch")


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak FLOP/s, or None (CPU, or a GPU not in ``PEAK_BF16``)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    found = [k for k in PEAK_BF16 if k in name]
    return PEAK_BF16[max(found, key=len)] if found else None


def model_flops_per_step(model: torch.nn.Module, shape: dict, micro: int, seq: int) -> float:
    """(6 N + 12 L h s) T: PaLM's model FLOPs, N without the input embedding (a lookup, no matmul)."""
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    return (6 * n + 12 * shape["num_hidden_layers"] * shape["hidden_size"] * seq) * micro * seq


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
    return optimizer_step(model, opt)


def _torch_baseline(model: torch.nn.Module):
    """torch alone on one GPU: fp32 weights, bf16 autocast, fused AdamW (no sharding library at all)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, **({"fused": True} if cuda() else {}))
    return optimizer_step(model, opt, autocast=torch.bfloat16)


def _shardwise(model: torch.nn.Module, micro: int):
    import shardwise

    cfg = engine_config(3, "bf16", micro=micro)
    cfg["optimizer"]["params"].update(lr=1e-4)
    engine, _, _, _ = shardwise.initialize(model=model, config=cfg)
    return engine_step(engine)


def step_worker(impl: str, smoke: bool) -> dict:
    """One run (one process): seconds per step (median of the measured steps) and peak memory."""
    join_world_of_one()
    from shardwise.comm import compute_device

    device = compute_device()
    shape, micro, seq, warmup, steps = (TINY, 2, 32, 1, 2) if smoke else (MODEL_1B, 4, 1024, 3, 8)
    model = llama(shape, device)
    numel = sum(p.numel() for p in model.parameters())
    flops = model_flops_per_step(model, shape, micro, seq)
    step = {"shardwise": lambda: _shardwise(model, micro), "fsdp2": lambda: _fsdp2(model),
            "torch": lambda: _torch_baseline(model)}[impl]()
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
    s_per_step, peak_flops_s = statistics.median(times[warmup:]), peak_flops(device)
    return {"impl": impl, "device": str(device), "params_B": numel / 1e9, "s_per_step": s_per_step,
            "peak_GiB": peak, "last_loss": loss, "tokens_per_step": micro * seq,
            "TFLOPs": flops / s_per_step / 1e12, "MFU": flops / s_per_step / peak_flops_s if peak_flops_s else None}


def step_vs_fsdp2(smoke: bool, workdir: str, limit_s: float) -> dict:
    if not cuda() and not smoke:
        return skip("no CUDA device")
    rounds = 1 if smoke else 2
    deadline, rows = time.monotonic() + limit_s - 5, []
    for r in range(rounds):
        for impl in IMPLS if r % 2 == 0 else IMPLS[::-1]:
            left = deadline - time.monotonic()
            if not in_own_process():  # --smoke in gpu_check's process: the code paths, not the peaks
                res = step_worker(impl, smoke)
            else:  # a fresh process per run, its own peak (--smoke --isolate takes this path on CPU)
                args = ["step_worker", "--impl", impl] + (["--smoke"] if smoke else [])
                res = run_child(args, os.path.join(workdir, f"step_{impl}_{r}.json"), left)
            rows.append({"round": r + 1, "impl": impl, **res})
            save_partial(rows)
    summary = summarize_steps(rows)
    notes = [f"median over rounds: {k} s/step {v['s_per_step']:.4f}, peak {v['peak_GiB']} GiB, MFU {v['MFU']}"
             for k, v in summary.items()]
    if "shardwise" in summary and "fsdp2" in summary:
        sw, fs = summary["shardwise"]["s_per_step"], summary["fsdp2"]["s_per_step"]
        notes.append(f"shardwise ZeRO-3 at {fs / sw:.2f}x FSDP2's speed (above 1: faster)")
    ok = all("error" not in x for x in rows)
    return {"status": "ok" if ok else "partial", "rows": rows, "summary": summary, "notes": notes}


def summarize_steps(rows: list[dict]) -> dict:
    """Per implementation, the medians over its rounds (s/step, peak GiB, MFU): what the goals compare."""
    out = {}
    for impl in IMPLS:
        done = [x for x in rows if x["impl"] == impl and "s_per_step" in x]
        if not done:
            continue
        med = {k: statistics.median(x[k] for x in done) if all(x.get(k) is not None for x in done) else None
               for k in ("s_per_step", "peak_GiB", "MFU")}
        out[impl] = {k: (round(v, 4) if v is not None else None) for k, v in med.items()}
    return out
