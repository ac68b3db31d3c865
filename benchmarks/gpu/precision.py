"""``precision``, a section of ``benchmarks/gpu_check.py``: DeepSpeed's low-precision master modes at ZeRO-3.

Each master mode (docs/precision.md) trains the same ~1B Llama on the same batches for a few AdamW steps
at ZeRO-3 in bf16 compute, each run in a fresh process (its own peak): fp32 masters (the default), a bf16
master with fp32 moments (Kahan), and a bf16 master with bf16 moments under each update rule (Kahan,
stochastic, nearest). FSDP2 runs beside them with the same precision policy: fp32 parameters under
``MixedPrecisionPolicy(param_dtype=bf16)`` (the fp32-master policy) and bf16 parameters (bf16 gradients
and moments, the policy of bf16 master + states with nearest rounding).

Measured as DeepSpeed's example reports its 31.4 -> 18.9 GB (a 6.86B model at ZeRO-3 with activation
checkpointing, batch 1 x 512): the peak allocated over the steps (``torch.cuda.max_memory_allocated``,
the resident state, the activations and every transient), with activation checkpointing, micro-batch
1 x 512; each peak is also given as a fraction of the fp32-master run's. The loss of the last step
and its gap to the fp32-master run's show what each mode does to training after a few steps (the
0.1B curves of docs/precision.md are the long-run measure). ``--smoke``: the tiny model on CPU, every
run in gpu_check's process; the peaks are left empty there (CUDA only).
"""

from __future__ import annotations

import os
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

LR = 1e-4
DEEPSPEED_RATIO = 18.93 / 31.38  # bf16 master + states over fp32 masters, DeepSpeed's example (peak)
BF16_STATES = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
# run name -> (impl, the config's bf16 keys or FSDP2's parameter dtype, shardwise.master_update)
RUNS: dict[str, tuple[str, object, str | None]] = {
    "fp32-masters": ("shardwise", {}, None),
    "bf16-master-kahan": ("shardwise", {"bf16_master_weights_and_grads": True}, "kahan"),
    "bf16-states-kahan": ("shardwise", BF16_STATES, "kahan"),
    "bf16-states-stochastic": ("shardwise", BF16_STATES, "stochastic"),
    "bf16-states-nearest": ("shardwise", BF16_STATES, "nearest"),
    "fsdp2-fp32-params": ("fsdp2", torch.float32, None),
    "fsdp2-bf16-params": ("fsdp2", torch.bfloat16, None),
}


def _shardwise_step(model: torch.nn.Module, keys: dict, update: str | None, micro: int):
    import shardwise

    cfg = engine_config(3, "bf16", micro=micro)
    cfg["optimizer"]["params"].update(lr=LR)
    cfg["bf16"].update(keys)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter sharded, as FSDP2
    if update is not None:
        cfg["shardwise"] = {"master_update": update}
    engine, _, _, _ = shardwise.initialize(model=model, config=cfg)
    return engine_step(engine)


def _fsdp2_step(model: torch.nn.Module, dtype: torch.dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model.to(dtype)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if dtype == torch.float32 else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    return optimizer_step(model, opt)


def precision_worker(run: str, smoke: bool) -> dict:
    """One run (one process on the GPU): peak and resident bytes of a few steps, the last loss."""
    join_world_of_one()
    from shardwise.comm import compute_device

    device = compute_device()
    impl, keys, update = RUNS[run]
    shape, micro, seq, steps = (TINY, 2, 32, 3) if smoke else (MODEL_1B, 1, 512, 4)
    model = llama(shape, device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    numel = sum(p.numel() for p in model.parameters())
    step = _shardwise_step(model, keys, update, micro) if impl == "shardwise" else _fsdp2_step(model, keys)
    ids = torch.randint(0, shape["vocab_size"], (steps, micro, seq),
                        generator=torch.Generator().manual_seed(1)).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses = [step(batch) for batch in ids]
    gib = (lambda b: b / 2**30) if device.type == "cuda" else (lambda b: None)
    peak = gib(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    resident = gib(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None
    return {"run": run, "impl": impl, "device": str(device), "params_B": numel / 1e9, "steps": steps,
            "tokens_per_step": micro * seq, "peak_GiB": peak, "allocated_after_GiB": resident,
            "last_loss": losses[-1]}


def precision(smoke: bool, workdir: str, limit_s: float) -> dict:
    if not cuda() and not smoke:
        return skip("no CUDA device")
    deadline, rows = time.monotonic() + limit_s - 5, []
    for run in RUNS:
        if not in_own_process():  # --smoke in gpu_check's process: the code paths, not the peaks
            res = precision_worker(run, smoke)
        else:
            args = ["precision_worker", "--impl", run] + (["--smoke"] if smoke else [])
            res = run_child(args, os.path.join(workdir, f"precision_{run}.json"), deadline - time.monotonic())
        rows.append({"run": run, **res})
        save_partial(rows)
    ref = next((r for r in rows if r["run"] == "fp32-masters" and "last_loss" in r), None)
    for r in rows:
        if ref is not None and "last_loss" in r:
            r["loss_gap_vs_fp32"] = r["last_loss"] - ref["last_loss"]
        if ref is not None and r.get("peak_GiB") is not None and ref.get("peak_GiB"):
            r["peak_vs_fp32_masters"] = r["peak_GiB"] / ref["peak_GiB"]
    ok = all("error" not in r for r in rows)
    return {"status": "ok" if ok else "partial", "rows": rows,
            "notes": [f"ZeRO-3 (every parameter sharded), bf16 compute, activation checkpointing, AdamW lr {LR:g}; "
                      "peak_GiB: torch.cuda.max_memory_allocated over the steps (each run a fresh process); "
                      "peak_vs_fp32_masters: against the fp32-master run, DeepSpeed's example reports "
                      f"{DEEPSPEED_RATIO:.3f} (18.93 / 31.38 GB) for its bf16 master + states; "
                      "loss_gap_vs_fp32: last step's loss minus the fp32-master run's, same model and batches"]}
