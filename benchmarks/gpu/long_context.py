"""``checkpoint_offload``, a section of ``benchmarks/gpu_check.py``: ALST's activation-checkpoint offload
(``shardwise.sequence_parallel.offload_checkpoints``) on one GPU.

One forward + backward of a Llama with HF activation checkpointing, without and with the offload:
the device memory allocated after the forward (what autograd keeps for backward: the checkpoint
inputs, which the offload moves to pinned host memory), the peak, the seconds, the bytes the
offload's store moved, and whether the loss and every gradient are bit-equal (they are in exact
arithmetic: the copies move bits; a GPU attention backward that is not deterministic would show
here as a tiny difference, reported as ``max_grad_rel``). ``--smoke`` (CPU): tiny sizes, no device
memory to read, the same code and the bytes counted.
"""

from __future__ import annotations

import time

import torch
from gpu.common import cuda, save_partial
from shared.models import llama

GPU_SHAPE = {"hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 8,
             "num_key_value_heads": 8, "vocab_size": 1024}
SMOKE_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 4, "vocab_size": 128}


def _run(shape: dict, batch: int, seq: int, offload: bool, device: str, dtype: torch.dtype) -> tuple[dict, dict]:
    from shardwise.sequence_parallel import offload_checkpoints

    model = llama(shape, device).to(dtype).train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    store = offload_checkpoints(model) if offload else None
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    on_gpu = device == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if on_gpu else 0
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    if on_gpu:
        torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before if on_gpu else None
    loss.backward()
    if on_gpu:
        torch.cuda.synchronize()
    row = {"offload": offload, "seq": seq, "batch": batch, "s_fwd_bwd": round(time.perf_counter() - t0, 3),
           "kept_after_forward_MiB": None if kept is None else round(kept / 2**20, 1),
           "peak_MiB": round(torch.cuda.max_memory_allocated() / 2**20, 1) if on_gpu else None,
           "moved_to_host_MiB": round(store.packed_bytes / 2**20, 4) if store else 0.0}
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return row, {"loss": loss.detach().float().cpu(), "grads": grads}


def checkpoint_offload(smoke: bool, workdir: str, limit_s: float) -> dict:  # noqa: ARG001
    on_gpu = cuda() and not smoke
    shape, batch, seq = (GPU_SHAPE, 4, 2048) if on_gpu else (SMOKE_SHAPE, 2, 32)
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    rows, results = [], []
    for offload in (False, True):
        row, res = _run(shape, batch, seq, offload, device, dtype)
        rows.append(row)
        results.append(res)
        save_partial(rows)
    plain, off = results
    rel = max(float((off["grads"][n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in plain["grads"].items())
    exact = torch.equal(plain["loss"], off["loss"]) and rel == 0.0
    inputs_mib = shape["num_hidden_layers"] * batch * seq * shape["hidden_size"] * (2 if on_gpu else 4) / 2**20
    for row in rows:
        row.update(bit_exact=exact, max_grad_rel=rel, checkpoint_inputs_MiB=round(inputs_mib, 4))
    notes = ["kept_after_forward: device bytes allocated by the forward and held for backward; with the offload "
             "it should drop by about checkpoint_inputs_MiB (the layers' input hidden states)"]
    return {"status": "ok", "rows": rows, "notes": notes}
