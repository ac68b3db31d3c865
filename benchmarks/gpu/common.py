"""Helpers shared by the gpu_check sections (benchmarks/gpu/sections.py, gpu/perf.py)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch
from shared.models import BETAS, EPS, LR, WD

SECTIONS_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sections.py")
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "vocab_size": 512}
STAGE_MODEL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 4, "vocab_size": 1024}
MODEL_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 16,
            "num_key_value_heads": 16, "vocab_size": 32000}  # 0.95B parameters
MODEL_13B = {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40, "num_attention_heads": 40,
             "num_key_value_heads": 40, "vocab_size": 32000}  # Llama-2-13B's shape: 13.0B parameters


def cuda() -> bool:
    return torch.cuda.is_available()


def skip(reason: str) -> dict:
    return {"status": "skipped", "reason": reason, "rows": []}


def join_world_of_one() -> None:
    """NCCL with CUDA (gloo without), one rank: what a single-GPU job gets from init_distributed."""
    import shardwise

    shardwise.init_distributed()


_RESULT: list[str] = []  # this section process's result file; empty when sections run in one process (--smoke)


def keep_result_at(path: str) -> None:
    _RESULT[:] = [path]


def in_own_process() -> bool:
    """Whether this section runs in a process of its own (the GPU run, ``--isolate``), not in gpu_check's."""
    return bool(_RESULT)


def save_partial(rows: list[dict], **extra: object) -> None:
    """The rows so far into the result file, so a section killed at its time limit still leaves them
    (written aside and renamed: a kill mid-write never leaves half a JSON)."""
    if not _RESULT:
        return
    tmp = _RESULT[0] + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"status": "partial", "rows": rows, **extra}, f, indent=1)
    os.replace(tmp, _RESULT[0])


def run_child(args: list[str], result: str, timeout_s: float) -> dict:
    """This script again, in a fresh process (a clean peak memory per run); its result or the error."""
    if timeout_s < 15:  # not even the imports and the NCCL setup would finish
        return {"error": f"not run: {max(timeout_s, 0):.0f} s left in the section's limit"}
    if os.path.exists(result):  # the workdir is kept between runs: never report an earlier run's numbers
        os.remove(result)
    cmd = [sys.executable, SECTIONS_SCRIPT, *args, "--result", result]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    try:
        with open(result) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}


# -- the same model and batches through the engine or plain torch -------------------------------------------
def batches(shape: dict, steps: int, device: torch.device, micro: int = 2, seq: int = 32) -> torch.Tensor:
    """``steps`` micro-batches of token ids, the same on every call (a fixed generator, made on the host)."""
    return torch.randint(0, shape["vocab_size"], (steps, micro, seq),
                         generator=torch.Generator().manual_seed(1)).to(device)


def host_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole, as fp32 on the host (gathered first at stage 3: a no-op below)."""
    from shardwise.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - w).abs().max()) for n, w in b.items())


def torch_run(model: torch.nn.Module, ids: torch.Tensor, **adamw: object) -> tuple[dict, float]:
    """Plain torch: ``len(ids)`` AdamW steps (the check's hyperparameters, ``adamw`` on top, e.g.
    ``fused=True``); the weights after and the last loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **adamw)
    loss = torch.zeros(())
    for batch in ids:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return host_weights(model), float(loss.detach())


def torch_spread(make: Callable[[], torch.nn.Module], ids: torch.Tensor,
                 others: dict[str, Callable[[], torch.nn.Module]] | None = None) -> dict:
    """What torch's own kernel choices give on the same model and batches: the default AdamW against
    ``fused=True``, against ``foreach=False``, and against itself (a second run); ``others``: more
    models torch computes the same math with (e.g. another experts kernel), trained with the default.
    The largest of these is the rounding freedom torch itself takes, so it is what an fp32 engine run
    may differ by. ``make``: a fresh model, the same weights each call."""
    device = ids.device
    default, loss = torch_run(make().to(device), ids)
    out: dict = {"ref_weights": default, "ref_loss": loss}
    runs = [("twice", make, {}), ("fused", make, {"fused": True}), ("foreach_off", make, {"foreach": False})]
    runs += [(name, other, {}) for name, other in (others or {}).items()]
    for name, build, kw in runs:
        w, _ = torch_run(build().to(device), ids, **kw)
        out[f"default_vs_{name}"] = max_abs_diff(w, default)
    out["spread"] = max(v for k, v in out.items() if k.startswith("default_vs_"))
    return out


def engine_run(make: Callable[[], torch.nn.Module], config: dict, ids: torch.Tensor, busy: bool = False) -> dict:
    """The engine on the model ``make`` builds and the same batches: weights after, last loss, s/step.

    ``busy`` (CUDA): before each backward and step, a long matmul is queued on the current stream, so
    every copy queued after it lands late; code that reads a ``non_blocking`` copy on the host before
    its event then reads stale bytes, and the run differs from a quiet one. Correct code is unmoved."""
    import time

    import shardwise

    model = make()
    engine, _, _, _ = shardwise.initialize(model=model, config=config)
    # all entries 1/4096: its square is itself (no overflow, and no random numbers drawn from the run's RNG)
    load = torch.full((4096, 4096), 1 / 4096, device=ids.device) if busy and ids.device.type == "cuda" else None
    t0 = time.perf_counter()
    loss = torch.zeros(())
    for batch in ids:
        loss = engine(input_ids=batch, labels=batch).loss
        for _ in range(0 if load is None else 8):  # ~1 TFLOP queued ahead of the backward's copies
            load = load @ load
        engine.backward(loss)
        for _ in range(0 if load is None else 8):
            load = load @ load
        engine.step()
    if ids.device.type == "cuda":  # the kernels are queued, not done: the clock waits for them
        torch.cuda.synchronize(ids.device)
    return {"weights": host_weights(model), "loss": float(loss.detach()),
            "s_per_step": (time.perf_counter() - t0) / len(ids)}


def copy_gbps(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
    """Median GB/s of ``dst.copy_(src)`` timed with CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return src.numel() * src.element_size() / statistics.median(times) / 1e9


def engine_step(engine) -> Callable[[torch.Tensor], float]:
    """One training step of a shardwise engine on a batch of token ids; returns the loss."""

    def step(ids: torch.Tensor) -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return float(loss)

    return step


def optimizer_step(model: torch.nn.Module, opt: torch.optim.Optimizer,
                   autocast: torch.dtype | None = None) -> Callable[[torch.Tensor], float]:
    """One plain torch step (FSDP2 or no library): forward, ``loss.backward()``, ``opt.step()``;
    ``autocast``: the forward under ``torch.autocast`` in that dtype."""
    device_type = next(model.parameters()).device.type

    def step(ids: torch.Tensor) -> float:
        with torch.autocast(device_type, dtype=autocast, enabled=autocast is not None):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss)

    return step

