"""The sections of ``benchmarks/gpu_check.py``, each run in its own process:

    python benchmarks/gpu/sections.py NAME --result FILE [--smoke] [--workdir DIR] [--limit-s S | --deadline T]

Each writes one JSON object to FILE: ``status`` (ok / partial / skipped), ``rows`` (the table),
``notes``. A failure inside a section is caught per row where it can be, so one broken case still
leaves the others' numbers. Without CUDA the CUDA-only sections are skipped; ``--smoke`` runs the
rest at tiny sizes on CPU (gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch

if not __package__:  # run as a script (its own process): benchmarks/, not benchmarks/gpu/, heads the path
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from gpu.common import (  # noqa: E402
    STAGE_MODEL,
    TINY,
    batches,
    copy_gbps,
    cuda,
    engine_run,
    join_world_of_one,
    keep_result_at,
    max_abs_diff,
    save_partial,
    skip,
    torch_spread,
)
from gpu.inference import zero_inference  # noqa: E402
from gpu.long_context import checkpoint_offload  # noqa: E402
from gpu.paths import checkpoint, parallel  # noqa: E402
from gpu.perf import step_vs_fsdp2, step_worker  # noqa: E402
from gpu.precision import precision, precision_worker  # noqa: E402
from gpu.train import train  # noqa: E402
from shared.models import LR, engine_config, llama  # noqa: E402

# -- stages ----------------------------------------------------------------------------------------------
# An fp32 engine run matches plain torch when it differs by at most SPREAD_MULTIPLE x torch's own spread,
# measured in the same run: torch's AdamW kernels (default, fused, foreach off) each round differently, and
# the engine steps a flat buffer with one of these kernels, so it sits in that same class of roundings. Two
# roundings of that class may lie on either side of the default (|e - d| <= |e - k| + |k - d|): 2x the spread.
SPREAD_MULTIPLE = 2.0


def _stage_row(case: tuple, shape: dict, ids: torch.Tensor, ref: dict) -> dict:
    """One engine case against the torch reference: weight difference, the bound it is held to, match."""
    stage, precision, offload = case
    run = engine_run(lambda: llama(shape), engine_config(stage, precision, offload), ids)
    want, steps = ref["ref_weights"], len(ids)
    absdiff = max_abs_diff(run["weights"], want)
    biggest = max(float(w.abs().max()) for w in want.values())
    # bf16: each AdamW step moves a weight by about lr at most whatever its gradient, so two runs part by
    # <= 2 lr per step, plus the bf16 rounding of the weights
    bound = SPREAD_MULTIPLE * ref["spread"] if precision == "fp32" else 2 * steps * LR + 2**-8 * biggest
    return {"stage": stage, "precision": precision, "offload": offload or "", "device": str(ids.device),
            "loss": run["loss"], "ref_loss": ref["ref_loss"], "max_abs_weight_diff": absdiff, "bound": bound,
            "matches": absdiff <= bound, "s_per_step": run["s_per_step"]}


def stages(smoke: bool, workdir: str, limit_s: float) -> dict:  # noqa: ARG001
    if not cuda() and not smoke:
        return skip("no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 compared with fp32
    torch.backends.cudnn.allow_tf32 = False
    join_world_of_one()
    import torch.distributed as dist

    from shardwise.comm import compute_device

    probe = torch.ones(4, device="cuda" if cuda() else "cpu")
    dist.all_reduce(probe)
    rows: list[dict] = [{"stage": "-", "precision": "-", "offload": "", "device": str(probe.device),
                         "backend": dist.get_backend(), "world": dist.get_world_size(),
                         "matches": bool(torch.equal(probe.cpu(), torch.ones(4)))}]
    shape = TINY if smoke else STAGE_MODEL
    ids = batches(shape, 3, compute_device())
    ref = torch_spread(lambda: llama(shape), ids)
    spread = {k: v for k, v in ref.items() if k.startswith("default_vs") or k == "spread"}
    rows.append({"stage": "torch", "precision": "fp32", "offload": "", "device": str(ids.device), **spread,
                 "matches": ref["default_vs_twice"] == 0.0})  # plain torch is deterministic
    save_partial(rows)
    cases = [(s, p, None) for s in range(4) for p in ("fp32", "bf16")]
    cases += [(2, "fp32", "optimizer"), (3, "fp32", "param")]
    if smoke:
        cases = [(0, "fp32", None), (2, "fp32", None), (3, "bf16", None)]
    for case in cases:
        label = {"stage": case[0], "precision": case[1], "offload": case[2] or ""}
        rows.append(_guarded(_stage_row, (case, shape, ids, ref), label))
        save_partial(rows)
    ok = all(r.get("matches") for r in rows)
    return {"status": "ok" if ok else "partial", "rows": rows, "spread": ref["spread"],
            "notes": [f"after 3 AdamW steps against plain torch fp32 (TF32 off), max_abs_weight_diff = largest "
                      f"|engine - torch| of any weight. Row 'torch': torch's own spread on the same model and "
                      f"batches (default AdamW against fused=True, foreach=False, and a second default run). fp32 "
                      f"matches when within {SPREAD_MULTIPLE:g} x that spread (0 spread: bit-exact); bf16 when "
                      f"within 2 lr per step + 2^-8 max |w|"]}


def determinism(smoke: bool, workdir: str, limit_s: float) -> dict:  # noqa: ARG001
    """Three identical runs of every stage and offload mode: every parameter bitwise equal after them."""
    if not cuda() and not smoke:
        return skip("no CUDA device")
    join_world_of_one()
    from shardwise.comm import compute_device

    shape = TINY if smoke else STAGE_MODEL
    ids = batches(shape, 3, compute_device())
    cases = [(s, "fp32", None) for s in range(4)] + [(2, "fp32", "optimizer"), (3, "fp32", "optimizer"),
                                                     (3, "fp32", "param")]
    if smoke:
        cases = [(0, "fp32", None), (3, "fp32", None), (2, "fp32", "optimizer")]
    rows: list[dict] = []
    for case in cases:
        label = {"stage": case[0], "precision": case[1], "offload": case[2] or ""}
        rows.append(_guarded(_repeat_case, (case, shape, ids, label), label))
        save_partial(rows)
    ok = all(r.get("matches") for r in rows)
    return {"status": "ok" if ok else "partial", "rows": rows,
            "notes": ["3 runs of 3 steps each from the same weights and batches, the third with long matmuls "
                      "queued before each backward and step (CUDA: copies land late, so a host read of an "
                      "unfenced copy shows); matches: torch.equal of every parameter between runs 1-2 and 1-3 "
                      "(bitwise); max_abs_between_runs: the largest difference"]}


def _repeat_case(case: tuple, shape: dict, ids: torch.Tensor, label: dict) -> dict:
    # the third run with the device kept busy (engine_run's ``busy``): a copy read before it lands shows
    runs = [engine_run(lambda: llama(shape), engine_config(*case), ids, busy=i == 2)["weights"] for i in range(3)]
    equal = all(torch.equal(r[n], runs[0][n]) for r in runs[1:] for n in runs[0])
    worst = max(max_abs_diff(r, runs[0]) for r in runs[1:])
    return {**label, "device": str(ids.device), "runs": len(runs), "matches": equal, "max_abs_between_runs": worst}


def _guarded(fn: Callable[..., dict], args: tuple, label: dict) -> dict:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - one failed case must not hide the others
        return {**label, "matches": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}


# -- offload bandwidth -----------------------------------------------------------------------------------
def offload_bandwidth(smoke: bool, workdir: str, limit_s: float) -> dict:  # noqa: ARG001
    if not cuda():
        return skip("no CUDA device")
    nbytes = (64 if smoke else 1024) << 20
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rows = []
    for kind, pin in (("pinned", True), ("pageable", False)):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        host.fill_(1)
        copy_gbps(dev, host, 1)  # warm up
        rows.append({"host memory": kind, "MiB": nbytes >> 20, "host_to_device_GBps": copy_gbps(dev, host, 5),
                     "device_to_host_GBps": copy_gbps(host, dev, 5)})
        save_partial(rows)
    return {"status": "ok", "rows": rows, "notes": ["median of 5 copies; offload_optimizer/offload_param move "
                                                    "their shards through pinned buffers when pin_memory is true"]}


SECTIONS: dict[str, Callable[[bool, str, float], dict]] = {
    "stages": stages, "determinism": determinism, "offload_bandwidth": offload_bandwidth,
    "checkpoint_offload": checkpoint_offload, "parallel": parallel, "checkpoint": checkpoint, "train": train,
    "step_vs_fsdp2": step_vs_fsdp2, "precision": precision, "zero_inference": zero_inference}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("name", choices=[*SECTIONS, "step_worker", "precision_worker"])
    p.add_argument("--result", required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--workdir", default="/tmp/shardwise_gpu_check")
    p.add_argument("--limit-s", type=float, default=300.0)
    p.add_argument("--deadline", type=float, default=None,
                   help="time.time() by which the caller kills this process; overrides --limit-s, so the "
                   "seconds spent starting Python and importing torch count against the section's limit")
    p.add_argument("--impl", default=None, help="step_worker: shardwise, fsdp2 or torch; precision_worker: "
                   "a run of gpu.precision.RUNS")
    args = p.parse_args(argv)
    keep_result_at(args.result)
    if args.name == "step_worker":
        res = step_worker(args.impl, args.smoke)
    elif args.name == "precision_worker":
        res = precision_worker(args.impl, args.smoke)
    else:
        limit_s = args.limit_s if args.deadline is None else args.deadline - time.time()
        res = SECTIONS[args.name](args.smoke, args.workdir, limit_s)
    with open(args.result, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
