"""The sections of ``benchmarks/gpu_check.py``, each run in its own process:

    python benchmarks/gpu_check_sections.py NAME --result FILE [--smoke] [--workdir DIR] [--limit-s S | --deadline T]

Each writes one JSON object to FILE: ``status`` (ok / partial / skipped), ``rows`` (the table),
``notes``. A failure inside a section is caught per row where it can be, so one broken case still
leaves the others' numbers. Without CUDA the CUDA-only sections are skipped; ``--smoke`` runs the
rest at tiny sizes on CPU (gloo).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from gpu_check_common import (
    BETAS,
    EPS,
    LR,
    STAGE_MODEL,
    TINY,
    WD,
    cuda,
    engine_config,
    join_world_of_one,
    keep_result_at,
    llama,
    save_partial,
    skip,
)
from gpu_check_long_context import checkpoint_offload
from gpu_check_perf import step_vs_fsdp2, step_worker, zero_inference


# -- stages ----------------------------------------------------------------------------------------------
def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from shardwise.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):  # a no-op below stage 3
        return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def _stage_case(stage: int, precision: str, offload: str | None, shape: dict, steps: int) -> dict:
    """3 steps of the engine against plain torch AdamW (fp32) on the same batches: weight difference."""
    import shardwise
    from shardwise.comm import compute_device

    device = compute_device()
    model = llama(shape)
    ref = copy.deepcopy(model).to(device)
    engine, _, _, _ = shardwise.initialize(model=model, config=engine_config(stage, precision, offload))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    ids = torch.randint(0, shape["vocab_size"], (steps, 2, 32), generator=torch.Generator().manual_seed(1)).to(device)
    t0 = time.perf_counter()
    for s in range(steps):
        loss = engine(input_ids=ids[s], labels=ids[s]).loss
        engine.backward(loss)
        engine.step()
        ref_loss = ref(input_ids=ids[s], labels=ids[s]).loss
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
    if device.type == "cuda":  # the kernels are queued, not done: the clock waits for them
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    got, want = _weights(model), {n: p.detach().float().cpu() for n, p in ref.named_parameters()}
    rel = max(float((got[n] - w).abs().max() / w.abs().max().clamp_min(1e-12)) for n, w in want.items())
    absdiff = max(float((got[n] - w).abs().max()) for n, w in want.items())
    biggest = max(float(w.abs().max()) for w in want.values())
    # fp32: the same math on one rank (TF32 off). bf16: each AdamW step moves a weight by about lr at most
    # whatever its gradient, so two runs part by <= 2 lr per step, plus the bf16 rounding of the weights.
    matches = rel <= 1e-4 if precision == "fp32" else absdiff <= 2 * steps * LR + 2**-8 * biggest
    return {"stage": stage, "precision": precision, "offload": offload or "", "device": str(device),
            "loss": float(loss), "ref_loss": float(ref_loss), "max_rel_weight_diff": rel,
            "max_abs_weight_diff": absdiff, "matches": matches, "s_per_step_with_ref": elapsed / steps}


def stages(smoke: bool, workdir: str, limit_s: float) -> dict:  # noqa: ARG001
    if not cuda() and not smoke:
        return skip("no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 compared with fp32
    torch.backends.cudnn.allow_tf32 = False
    join_world_of_one()
    import torch.distributed as dist

    probe = torch.ones(4, device="cuda" if cuda() else "cpu")
    dist.all_reduce(probe)
    rows: list[dict] = [{"stage": "-", "precision": "-", "offload": "", "device": str(probe.device),
                         "backend": dist.get_backend(), "world": dist.get_world_size(),
                         "matches": bool(torch.equal(probe.cpu(), torch.ones(4)))}]
    cases = [(s, p, None) for s in range(4) for p in ("fp32", "bf16")]
    cases += [(2, "fp32", "optimizer"), (3, "fp32", "param")]
    if smoke:
        cases = [(0, "fp32", None), (2, "fp32", None), (3, "bf16", None)]
    for case in cases:
        label = {"stage": case[0], "precision": case[1], "offload": case[2] or ""}
        rows.append(_guarded(_stage_case, (*case, TINY if smoke else STAGE_MODEL, 3), label))
        save_partial(rows)
    ok = all(r.get("matches") for r in rows)
    return {"status": "ok" if ok else "partial", "rows": rows,
            "notes": ["after 3 AdamW steps against plain torch fp32: fp32 matches when max_rel_weight_diff "
                      "(largest |engine - torch| / max |torch| of a parameter) <= 1e-4; bf16 when "
                      "max_abs_weight_diff <= 2 lr per step + 2^-8 max |w|"]}


def _guarded(fn: Callable[..., dict], args: tuple, label: dict) -> dict:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - one failed case must not hide the others
        return {**label, "matches": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}


# -- offload bandwidth -----------------------------------------------------------------------------------
def _copy_gbps(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
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


def offload_bandwidth(smoke: bool, workdir: str, limit_s: float) -> dict:  # noqa: ARG001
    if not cuda():
        return skip("no CUDA device")
    nbytes = (64 if smoke else 1024) << 20
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rows = []
    for kind, pin in (("pinned", True), ("pageable", False)):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        host.fill_(1)
        _copy_gbps(dev, host, 1)  # warm up
        rows.append({"host memory": kind, "MiB": nbytes >> 20, "host_to_device_GBps": _copy_gbps(dev, host, 5),
                     "device_to_host_GBps": _copy_gbps(host, dev, 5)})
        save_partial(rows)
    return {"status": "ok", "rows": rows, "notes": ["median of 5 copies; offload_optimizer/offload_param move "
                                                    "their shards through pinned buffers when pin_memory is true"]}


SECTIONS: dict[str, Callable[[bool, str, float], dict]] = {
    "stages": stages, "offload_bandwidth": offload_bandwidth, "checkpoint_offload": checkpoint_offload,
    "step_vs_fsdp2": step_vs_fsdp2, "zero_inference": zero_inference}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("name", choices=[*SECTIONS, "step_worker"])
    p.add_argument("--result", required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--workdir", default="/tmp/shardwise_gpu_check")
    p.add_argument("--limit-s", type=float, default=300.0)
    p.add_argument("--deadline", type=float, default=None,
                   help="time.time() by which the caller kills this process; overrides --limit-s, so the "
                   "seconds spent starting Python and importing torch count against the section's limit")
    p.add_argument("--impl", default=None, help="step_worker: shardwise or fsdp2")
    args = p.parse_args(argv)
    keep_result_at(args.result)
    if args.name == "step_worker":
        res = step_worker(args.impl, args.smoke)
    else:
        limit_s = args.limit_s if args.deadline is None else args.deadline - time.time()
        res = SECTIONS[args.name](args.smoke, args.workdir, limit_s)
    with open(args.result, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
